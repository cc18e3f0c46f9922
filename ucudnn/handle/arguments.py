"""A kernel call's arguments checked and its missing shapes inferred, before anything is planned or run:
a bad argument is refused as `InvalidInput` with the value that was wrong, not as a backend's failure."""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence
from typing import Any

from ucudnn.errors import InvalidInput
from ucudnn.handle.kernel import _Prepared

_Pair = int | Sequence[int]


def _pair(name: str, value: _Pair, minimum: int) -> tuple[int, int]:
    pair: tuple[int, ...]
    if isinstance(value, int) and not isinstance(value, bool):
        pair = (value, value)
    else:
        try:
            pair = tuple(value)  # type: ignore[arg-type]  # a bool gets here, and tuple() refuses it: caught below
        except TypeError:
            raise InvalidInput(f"{name} must be an integer or a pair of integers, got {value!r}") from None
        if len(pair) != 2:
            raise InvalidInput(f"{name} must be an integer or a pair of integers, got {value!r}")
    for v in pair:
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            rule = "non-negative" if minimum == 0 else "positive"
            raise InvalidInput(f"{name} must hold {rule} integers, got {value!r}")
    return pair


def _shape4(name: str, array_or_shape: Any) -> tuple[int, int, int, int]:
    """The shape of a 4-D array, or a 4-entry shape itself, as a tuple of ints."""
    shape = getattr(array_or_shape, "shape", array_or_shape)
    if (
        type(shape) is tuple
        and len(shape) == 4
        and type(shape[0]) is type(shape[1]) is type(shape[2]) is type(shape[3]) is int
    ):  # the hot path: an array's own shape
        return shape
    try:
        shape = tuple(operator.index(v) for v in shape if not isinstance(v, bool))
        if len(shape) == 4:
            return shape
    except TypeError:
        pass
    raise InvalidInput(
        f"{name} must be a 4-D NCHW array or a shape of 4 integers, got "
        f"{getattr(array_or_shape, 'shape', array_or_shape)!r}"
    )


def _shape_nd(name: str, array_or_shape: Any) -> tuple[int, ...]:
    """The shape of a 3-D, 4-D or 5-D array (1, 2 or 3 spatial axes), or such a shape, as ints."""
    shape = getattr(array_or_shape, "shape", array_or_shape)
    try:
        shape = tuple(operator.index(v) for v in shape if not isinstance(v, bool))
        if len(shape) in (3, 4, 5):
            return shape
    except TypeError:
        pass
    raise InvalidInput(
        f"{name} must be a 3-D, 4-D or 5-D array or shape (batch, channels, 1 to 3 spatial axes), "
        f"got {getattr(array_or_shape, 'shape', array_or_shape)!r}"
    )


def _per_axis(value: Any, axes: int) -> Any:
    """An int or a sequence as a tuple of one value per axis (hashable); anything else as it is,
    for the problem to refuse with its field named."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * axes
    try:
        return tuple(value)
    except TypeError:
        return value


_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    """str(dtype), memoised: NumPy builds a dtype's name in Python, a few microseconds per call."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def _same_dtype(a: Any, b: Any) -> None:
    if a.dtype != b.dtype:
        raise InvalidInput(f"the two operands must share a dtype, got {a.dtype} and {b.dtype}")


def _check_no_overlap(out: Any, **inputs: Any) -> None:
    """Refuse an output that shares memory with an input: kernels write `out` while still reading
    their inputs (shift_gemm, for one, accumulates into out sample by sample)."""
    module = _array_module(out)
    for name, array in inputs.items():
        if module.may_share_memory(out, array):
            raise InvalidInput(
                f"out overlaps {name}: a kernel cannot write its result over an operand it reads; give a separate out"
            )


def _geometry(stride: _Pair, padding: _Pair, dilation: _Pair) -> tuple[tuple[int, int], ...]:
    """stride, padding and dilation as checked (height, width) pairs."""
    return _pair("stride", stride, 1), _pair("padding", padding, 0), _pair("dilation", dilation, 1)


def _positive_groups(groups: Any) -> None:
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise InvalidInput(f"groups must be a positive integer, got {groups!r}")


def _check_groups(groups: Any, c: int, w_shape: Sequence[int]) -> None:
    _positive_groups(groups)
    if w_shape[1] * groups != c:
        raise InvalidInput(
            f"the filter's input channels ({w_shape[1]}) times groups ({groups}) must equal the input's channels ({c})"
        )
    if w_shape[0] % groups:
        raise InvalidInput(f"groups ({groups}) must divide the filter's output channels ({w_shape[0]})")


def _infer_x_shape(dy_shape, w_shape, stride, padding, dilation, groups) -> tuple[int, int, int, int]:
    """The input shape of a convolution from its output and filter, where that is unambiguous."""
    stride, padding, dilation = _geometry(stride, padding, dilation)
    _positive_groups(groups)
    if stride != (1, 1):
        # out = (h + 2p - d(r-1) - 1) // stride + 1 fixes h only when the stride is 1
        raise InvalidInput(
            "conv_backward_data cannot tell the input size from dy when the stride is above 1; give x_shape or out"
        )
    sizes = [dy_shape[2 + a] - 1 - 2 * padding[a] + dilation[a] * (w_shape[2 + a] - 1) + 1 for a in (0, 1)]
    return (dy_shape[0], w_shape[1] * groups, *sizes)


def _infer_w_shape(x_shape, dy_shape, stride, padding, dilation, groups) -> tuple[int, int, int, int]:
    """The filter shape of a convolution from its input and output, where that is unambiguous."""
    stride, padding, dilation = _geometry(stride, padding, dilation)
    _positive_groups(groups)
    if stride != (1, 1):
        raise InvalidInput(
            "conv_backward_filter cannot tell the filter size from x and dy when the stride is "
            "above 1; give w_shape or out"
        )
    sizes = []
    for a in (0, 1):
        span = x_shape[2 + a] + 2 * padding[a] - dy_shape[2 + a]  # = dilation * (r - 1)
        if span < 0 or span % dilation[a]:
            raise InvalidInput(
                f"no filter size maps an input of {x_shape[2 + a]} to an output of {dy_shape[2 + a]} "
                f"with padding {padding[a]} and dilation {dilation[a]}"
            )
        sizes.append(span // dilation[a] + 1)
    return (dy_shape[1], x_shape[1] // groups, *sizes)


def _array_module(array: Any):
    """numpy, or cupy for a CuPy array (cupy is imported only when such an array is given)."""
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(array, cupy.ndarray):
        return cupy
    import numpy

    return numpy


def _contiguous(array: Any) -> Any:
    return array if array.flags.c_contiguous else _array_module(array).ascontiguousarray(array)


def _output(out: Any, prep: _Prepared, beta: float, like: Any, **inputs: Any) -> Any:
    """The array a kernel call writes: a new one, or the caller's `out` once it is checked."""
    problem = prep.problem
    if out is None:
        if beta != 0:
            raise InvalidInput(f"beta={beta} blends the result into an existing output; give out")
        # Zeros, not empty: with beta = 0 a backend may still read out (0 * NaN is NaN).
        return _array_module(like).zeros(prep.out_shape, dtype=like.dtype)
    if tuple(out.shape) != prep.out_shape:
        raise InvalidInput(f"out has shape {tuple(out.shape)}, the {problem.kind} kernel writes {problem.out_shape}")
    if out.dtype != like.dtype:
        raise InvalidInput(f"out has dtype {out.dtype}, the operands {like.dtype}")
    if not out.flags.c_contiguous:
        raise InvalidInput("out must be C-contiguous (NCHW); the kernel writes into it in place")
    if _array_module(out) is not _array_module(like):
        raise InvalidInput("out and the operands must live on the same device (NumPy or CuPy arrays alike)")
    _check_no_overlap(out, **inputs)
    return out
