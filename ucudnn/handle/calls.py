"""The Handle's kernel calls (a mixin of `Handle`): the three convolutions on arrays (`conv_forward`,
`conv_backward_data`, `conv_backward_filter`), `prepare` and `kernel`, and `_lookup`, which turns a call's
arguments into what runs: a dict hit on repeated calls, else the problem built, checked and planned."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ucudnn.errors import InvalidInput
from ucudnn.handle.arguments import (
    _check_groups,
    _contiguous,
    _dtype_name,
    _geometry,
    _infer_w_shape,
    _infer_x_shape,
    _output,
    _Pair,
    _per_axis,
    _positive_groups,
    _same_dtype,
    _shape4,
    _shape_nd,
)
from ucudnn.handle.kernel import Kernel, _Prepared
from ucudnn.problem import KINDS, ConvProblem
from ucudnn.solver.types import Configuration


class _Calls:
    """The Handle's public kernel calls and their lookup (a mixin of `Handle`)."""

    # the Handle's state it uses (`Handle.__init__` says what each is)
    _prepared: dict[tuple, _Prepared]
    _generation: int

    if TYPE_CHECKING:  # the Handle's planning of a call, and its launch's (`_Launching`)

        def _prepare(self, layer: str | None, problem: ConvProblem, budget: int | None = None) -> _Prepared: ...

        def _run(
            self, prep: _Prepared, *, x: Any = None, w: Any = None, dy: Any = None, out: Any, alpha: float, beta: float
        ) -> None: ...

    def conv_forward(
        self,
        x: Any,
        w: Any,
        *,
        stride: _Pair = 1,
        padding: _Pair = 0,
        dilation: _Pair = 1,
        groups: int = 1,
        alpha: float = 1.0,
        beta: float = 0.0,
        out: Any = None,
        layer: str | None = None,
    ) -> Any:
        """y = alpha * conv2d(x, w) + beta * out, for x (n, c, h, w) and w (k, c/groups, r, s).

        Without `out`, a new y is allocated and returned (`beta` must then be 0). With `out` (a
        contiguous array of y's shape and dtype), the result is written into it and `out` is
        returned. `layer` names the layer (WD gives each layer's kernels their own segment; None
        uses the shape as the name, so layers of one shape share a segment).
        """
        xs, ws = _shape4("x", x), _shape4("w", w)
        _same_dtype(x, w)
        prep = self._lookup("fwd", layer, xs, ws, stride, padding, dilation, groups, _dtype_name(x.dtype))
        out = _output(out, prep, beta, x, x=x, w=w)
        self._run(prep, x=_contiguous(x), w=_contiguous(w), out=out, alpha=alpha, beta=beta)
        return out

    def conv_backward_data(
        self,
        dy: Any,
        w: Any,
        *,
        x_shape: Sequence[int] | None = None,
        stride: _Pair = 1,
        padding: _Pair = 0,
        dilation: _Pair = 1,
        groups: int = 1,
        alpha: float = 1.0,
        beta: float = 0.0,
        out: Any = None,
        layer: str | None = None,
    ) -> Any:
        """dx = alpha * (gradient of conv2d w.r.t. its input, given dy) + beta * out.

        The input shape comes from `x_shape`, or from `out`'s shape; without either it is inferred
        where that is unambiguous (stride 1 on both axes). The rest is as in `conv_forward`.
        """
        dys, ws = _shape4("dy", dy), _shape4("w", w)
        _same_dtype(dy, w)
        if x_shape is None:
            x_shape = out.shape if out is not None else _infer_x_shape(dys, ws, stride, padding, dilation, groups)
        prep = self._lookup(
            "bwd_data", layer, _shape4("x_shape", x_shape), ws, stride, padding, dilation, groups, _dtype_name(dy.dtype)
        )
        if dys != prep.problem.y_shape:
            raise InvalidInput(
                f"dy has shape {dys}, but the convolution of an input {prep.problem.x_shape} with "
                f"w {ws} writes {prep.problem.y_shape}"
            )
        out = _output(out, prep, beta, dy, dy=dy, w=w)
        self._run(prep, dy=_contiguous(dy), w=_contiguous(w), out=out, alpha=alpha, beta=beta)
        return out

    def conv_backward_filter(
        self,
        x: Any,
        dy: Any,
        *,
        w_shape: Sequence[int] | None = None,
        stride: _Pair = 1,
        padding: _Pair = 0,
        dilation: _Pair = 1,
        groups: int = 1,
        alpha: float = 1.0,
        beta: float = 0.0,
        out: Any = None,
        layer: str | None = None,
    ) -> Any:
        """dw = alpha * (gradient of conv2d w.r.t. its filter, given x and dy) + beta * out.

        The filter shape comes from `w_shape`, or from `out`'s shape; without either it is inferred
        where that is unambiguous (stride 1 on both axes). Micro-batch gradients are summed into
        the result. The rest is as in `conv_forward`.
        """
        xs, dys = _shape4("x", x), _shape4("dy", dy)
        _same_dtype(x, dy)
        if w_shape is None:
            w_shape = out.shape if out is not None else _infer_w_shape(xs, dys, stride, padding, dilation, groups)
        prep = self._lookup(
            "bwd_filter",
            layer,
            xs,
            _shape4("w_shape", w_shape),
            stride,
            padding,
            dilation,
            groups,
            _dtype_name(x.dtype),
        )
        if dys != prep.problem.y_shape:
            raise InvalidInput(
                f"dy has shape {dys}, but the convolution of x {xs} with a filter "
                f"{prep.problem.w_shape} writes {prep.problem.y_shape}"
            )
        out = _output(out, prep, beta, x, x=x, dy=dy)
        self._run(prep, x=_contiguous(x), dy=_contiguous(dy), out=out, alpha=alpha, beta=beta)
        return out

    def prepare(
        self,
        kind: str,
        x_shape: Sequence[int],
        w_shape: Sequence[int],
        *,
        stride: _Pair = 1,
        padding: _Pair = 0,
        dilation: _Pair = 1,
        groups: int = 1,
        dtype: str = "float32",
        layer: str | None = None,
        transposed: bool = False,
        output_padding: _Pair = 0,
    ) -> Configuration:
        """Plan a kernel now (measuring and solving if needed) and return the configuration it runs.

        The arguments describe the convolution as the kernel calls do: `x_shape` (n, c, h, w) and
        `w_shape` (k, c/groups, r, s) for every kind. The call that follows with the same arguments
        runs exactly this configuration; like cudnnGet*Algorithm, this lets a framework plan during
        setup, or inspect the plan. (WD: the first `prepare` solves the network, as a convolution
        would.) The workspace is taken when the kernel first runs through the handle. Every form
        that `kernel` takes is taken here too.
        """
        if kind not in KINDS:
            raise InvalidInput(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        return self._lookup(
            kind,
            layer,
            _shape_nd("x_shape", x_shape),
            _shape_nd("w_shape", w_shape),
            stride,
            padding,
            dilation,
            groups,
            str(dtype),
            transposed=transposed,
            output_padding=output_padding,
        ).config

    def kernel(
        self,
        kind: str,
        x_shape: Sequence[int],
        w_shape: Sequence[int],
        *,
        stride: _Pair = 1,
        padding: _Pair = 0,
        dilation: _Pair = 1,
        groups: int = 1,
        dtype: str = "float32",
        layout: str = "NCHW",
        layer: str | None = None,
        budget: int | None = None,
        transposed: bool = False,
        output_padding: _Pair = 0,
    ) -> Kernel:
        """`prepare`, returning the planned kernel itself, ready to run without a lookup.

        For frameworks that call one layer's kernels many times (``ucudnn.torch`` holds one per
        layer and shape): `Kernel.run` skips the per-call lookup and checks, and `layout`
        ("NHWC": channels-last operands, logical NCHW shapes) and `dtype` (say "bfloat16", whose
        arrays hold raw 16-bit words) describe operands whose array dtype does not say it.

        Every form of PyTorch's convolutions (`ConvProblem.from_shapes`): `x_shape` (n, c, l),
        (n, c, h, w) or (n, c, d, h, w) with the module's weight shape, `stride`, `padding`,
        `dilation` (and `output_padding`) an int or one per spatial axis; `transposed=True` for
        ConvTranspose1d/2d/3d, whose weight is (c, k/groups, ...). The kernel runs on operands of
        `kernel.problem`'s shapes: a 1-D input is the (n, c, 1, l) view (a 2-D problem of height 1).

        `budget` (bytes): a memory plan's workspace for this kernel. The kernel then runs the
        fastest configuration within it (and within the handle's own WR limit), WR-style in either
        mode, and takes its workspace for each run rather than from the handle's shared buffer or
        arena: the plan counted that memory at this kernel's step only.
        """
        if kind not in KINDS:
            raise InvalidInput(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise InvalidInput(f"budget must be a non-negative number of bytes or None, got {budget!r}")
        prep = self._lookup(
            kind,
            layer,
            _shape_nd("x_shape", x_shape),
            _shape_nd("w_shape", w_shape),
            stride,
            padding,
            dilation,
            groups,
            str(dtype),
            layout,
            budget,
            transposed=transposed,
            output_padding=output_padding,
        )
        return Kernel(self, prep, self._generation)

    def _lookup(
        self,
        kind: str,
        layer: str | None,
        x_shape: tuple[int, ...],
        w_shape: tuple[int, ...],
        stride: _Pair,
        padding: _Pair,
        dilation: _Pair,
        groups: int,
        dtype: str,
        layout: str = "NCHW",
        budget: int | None = None,
        *,
        transposed: bool = False,
        output_padding: _Pair = 0,
    ) -> _Prepared:
        """What to run for this call: a dict hit on repeated calls, else the problem is built and planned."""
        signature: tuple = (kind, layer, x_shape, w_shape, stride, padding, dilation, groups, dtype, layout, budget)
        if transposed or output_padding != 0:  # the eager 2-D calls keep their signature (the hot path)
            signature += (transposed, output_padding)
        try:
            prep = self._prepared.get(signature)
        except TypeError:  # an unhashable argument (a list for stride, ...): normalised below
            prep = None
        if prep is not None:
            return prep
        if len(x_shape) == 4 and len(w_shape) == 4 and not transposed and output_padding == 0:
            stride, padding, dilation = _geometry(stride, padding, dilation)
            _check_groups(groups, x_shape[1], w_shape)
            n, c, h, w = x_shape
            problem = ConvProblem(
                kind=kind,
                n=n,
                c=c,
                h=h,
                w=w,
                k=w_shape[0],
                r=w_shape[2],
                s=w_shape[3],
                pad_h=padding[0],
                pad_w=padding[1],
                stride_h=stride[0],
                stride_w=stride[1],
                dilation_h=dilation[0],
                dilation_w=dilation[1],
                groups=groups,
                dtype=dtype,
                layout=layout,
            )
            normalised: tuple = (
                kind,
                layer,
                x_shape,
                w_shape,
                stride,
                padding,
                dilation,
                groups,
                dtype,
                layout,
                budget,
            )
        else:  # 1-D, 3-D or transposed: the problem checks every value and names what is wrong
            _positive_groups(groups)
            if not isinstance(transposed, bool):
                raise InvalidInput(f"transposed must be True or False, got {transposed!r}")
            axes = len(x_shape) - 2
            stride, padding, dilation, output_padding = (
                _per_axis(v, axes) for v in (stride, padding, dilation, output_padding)
            )
            problem = ConvProblem.from_shapes(
                x_shape,
                w_shape,
                stride=stride,
                padding=padding,
                dilation=dilation,
                groups=groups,
                transposed=transposed,
                output_padding=output_padding,
                kind=kind,
                dtype=dtype,
                layout=layout,
            )
            normalised = (
                kind,
                layer,
                x_shape,
                w_shape,
                stride,
                padding,
                dilation,
                groups,
                dtype,
                layout,
                budget,
                transposed,
                output_padding,
            )
        prep = self._prepare(layer, problem, budget)
        try:
            self._prepared[signature] = prep
        except TypeError:
            pass
        # the normalised spelling too, so that equal calls spelled differently hit the same entry
        self._prepared[normalised] = prep
        return prep
