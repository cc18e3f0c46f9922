"""`ConvProblem`: one convolution kernel, as a frozen value with a canonical text key.

The forms a problem takes (every one for each kind: fwd, bwd_data, bwd_filter):

- **2-D** (the default): x is (n, c, h, w), the filter w (k, c/groups, r, s), y (n, k, out_h, out_w).
- **3-D**: give the input depth `d` (0, the default, means no depth axis). x is (n, c, d, h, w), w
  (k, c/groups, t, r, s), y (n, k, out_d, out_h, out_w); `t`, `pad_d`, `stride_d` and `dilation_d` are
  the depth axis' filter size, padding, stride and dilation.
- **1-D** is a 2-D problem of height 1: h=1, r=1, pad_h=0 (stride_h and dilation_h 1). A Conv1d's
  input (n, c, l) is the view (n, c, 1, l), its filter (k, c/groups, s) the view (k, c/groups, 1, s).
  It has no keys of its own: every 2-D algorithm runs it as it is, and its cache key is a 2-D key.
- **Transposed** (`transposed=True`, PyTorch's ConvTranspose1d/2d/3d): x (n, c, [d,] h, w) is the
  transposed convolution's input, w is (c, k/groups, [t,] r, s) as ConvTranspose's weight, and y is
  (n, k, ...) with out = (size - 1) * stride - 2 * pad + dilation * (filter - 1) + output_padding + 1
  per axis. `kind` names the transposed convolution's own kernels (fwd: x, w -> y; bwd_data: dy, w
  -> dx; bwd_filter: x, dy -> dw). Each is a kernel of an ordinary convolution (`lowered`): the
  forward is a convolution's backward data, the backward data a forward, and the filter gradient
  the convolution's with x and dy's roles swapped. `output_padding_*` (transposed only) must be
  below the axis' stride, as PyTorch requires (PyTorch also allows it below the dilation; that
  form has no such convolution and is refused).

`layout` NCHW means channels first for every form (NCDHW in 3-D), NHWC channels last (NDHWC).
Every field is validated on construction; errors say what was wrong and what to do.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ucudnn.errors import InvalidInput

KINDS = ("fwd", "bwd_data", "bwd_filter")
DTYPES = ("float32", "float64", "float16", "bfloat16")
LAYOUTS = ("NCHW", "NHWC")
# The kernel of the ordinary convolution that computes each kernel of a transposed one (`lowered`).
LOWERED_KIND = {"fwd": "bwd_data", "bwd_data": "fwd", "bwd_filter": "bwd_filter"}

# Per spatial axis: the fields of its input size, filter size, padding, stride, dilation, output padding.
_AXIS_FIELDS = {
    "d": ("d", "t", "pad_d", "stride_d", "dilation_d", "output_padding_d"),
    "h": ("h", "r", "pad_h", "stride_h", "dilation_h", "output_padding_h"),
    "w": ("w", "s", "pad_w", "stride_w", "dilation_w", "output_padding_w"),
}
# Spec keys that set every axis the problem has (d, h, w in 3-D; h, w in 2-D).
_ALL_AXES = {"pad": "pad", "stride": "stride", "dilation": "dilation", "output_padding": "output_padding"}
_INT_FIELDS = (
    "n",
    "c",
    "h",
    "w",
    "k",
    "r",
    "s",
    "pad_h",
    "pad_w",
    "stride_h",
    "stride_w",
    "dilation_h",
    "dilation_w",
    "groups",
    "d",
    "t",
    "pad_d",
    "stride_d",
    "dilation_d",
    "output_padding_h",
    "output_padding_w",
    "output_padding_d",
)
_NON_NEGATIVE = ("pad_h", "pad_w", "pad_d", "d", "output_padding_h", "output_padding_w", "output_padding_d")
# What only a 3-D problem may set (a 2-D one keeps them at their defaults).
_DEPTH_FIELDS = ("t", "pad_d", "stride_d", "dilation_d", "output_padding_d")
_OUTPUT_PADDING = ("output_padding_d", "output_padding_h", "output_padding_w")
_REQUIRED = ("c", "h", "w", "k", "r", "s")
# Fields added after the first release. The key names them only when they differ from their
# defaults, so a 2-D problem's key, and every measurement cached under it, is what it was.
_LATER_FIELDS = ("d", "t", "pad_d", "stride_d", "dilation_d", "transposed", *_OUTPUT_PADDING)
# Every key `ConvProblem.parse` reads, in the order a person writes them: the 2-D keys first, as
# the first release listed them, then those of the depth axis, transposed convolutions and the rest.
SPEC_KEYS = (
    "n",
    "c",
    "h",
    "w",
    "k",
    "r",
    "s",
    "pad",
    "pad_h",
    "pad_w",
    "stride",
    "stride_h",
    "stride_w",
    "dilation",
    "dilation_h",
    "dilation_w",
    "groups",
    "d",
    "t",
    "pad_d",
    "stride_d",
    "dilation_d",
    "transposed",
    "output_padding",
    "output_padding_h",
    "output_padding_w",
    "output_padding_d",
    "dtype",
    "compute_type",
    "layout",
    "kind",
)


_FIELD_WORDS = re.compile(r"ConvProblem field '(\w+)'")


def _in_spec_words(message: str, written: Mapping[str, str]) -> str:
    """A ConvProblem refusal as a layer spec's reader says it: `pad must be non-negative, got -1` for
    `ConvProblem field 'pad_h' must be ...` when the spec wrote `pad=-1`."""
    message = _FIELD_WORDS.sub(lambda m: written.get(m.group(1), m.group(1)), message)
    return message.replace("ConvProblem transposed output", "the transposed output").replace(
        "ConvProblem output", "the output"
    )


@dataclass(frozen=True, slots=True)
class Axis:
    """One spatial axis of a problem: x's extent, the filter's, padding, stride, dilation, output
    padding (transposed only) and y's extent."""

    name: str  # "d", "h" or "w"
    size: int
    filter: int
    pad: int
    stride: int
    dilation: int
    output_padding: int
    out: int

    @property
    def dilated(self) -> int:
        return (self.filter - 1) * self.dilation + 1


def _out_size(
    size: int, filter_: int, pad: int, stride: int, dilation: int, output_padding: int, transposed: bool
) -> int:
    dilated = (filter_ - 1) * dilation + 1
    if transposed:
        return (size - 1) * stride - 2 * pad + dilated + output_padding
    return (size + 2 * pad - dilated) // stride + 1


@dataclass(frozen=True, slots=True)
class ConvProblem:
    """A convolution kernel of 1, 2 or 3 spatial dimensions, plain or transposed (module docstring).

    2-D: input `x` is (n, c, h, w), filter `w` (k, c/groups, r, s). `kind` names which of the three
    kernels this is: `fwd` (x, w -> y), `bwd_data` (dy, w -> dx) or `bwd_filter` (x, dy -> dw).
    """

    kind: str = "fwd"
    n: int = 1
    c: int = 1
    h: int = 1
    w: int = 1
    k: int = 1
    r: int = 1
    s: int = 1
    pad_h: int = 0
    pad_w: int = 0
    stride_h: int = 1
    stride_w: int = 1
    dilation_h: int = 1
    dilation_w: int = 1
    groups: int = 1
    dtype: str = "float32"
    compute_type: str = ""  # "" means the same as dtype
    layout: str = "NCHW"
    d: int = 0  # input depth; 0: a 2-D problem, no depth axis
    t: int = 1  # filter depth
    pad_d: int = 0
    stride_d: int = 1
    dilation_d: int = 1
    transposed: bool = False
    output_padding_h: int = 0  # transposed only, each below its axis' stride
    output_padding_w: int = 0
    output_padding_d: int = 0

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidInput(f"ConvProblem field {name!r} must be an integer, got {value!r}")
            minimum = 0 if name in _NON_NEGATIVE else 1
            if value < minimum:
                rule = "non-negative" if minimum == 0 else "positive"
                raise InvalidInput(f"ConvProblem field {name!r} must be {rule}, got {value}")
        if not isinstance(self.transposed, bool):
            raise InvalidInput(f"ConvProblem field 'transposed' must be True or False, got {self.transposed!r}")
        if self.kind not in KINDS:
            raise InvalidInput(f"ConvProblem field 'kind' must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.dtype not in DTYPES:
            raise InvalidInput(f"ConvProblem field 'dtype' must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.compute_type and self.compute_type not in DTYPES:
            raise InvalidInput(
                f"ConvProblem field 'compute_type' must be one of {', '.join(DTYPES)}, got {self.compute_type!r}"
            )
        if self.layout not in LAYOUTS:
            raise InvalidInput(f"ConvProblem field 'layout' must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if not self.d:
            for name in _DEPTH_FIELDS:
                if getattr(self, name) != _DEFAULTS[name]:
                    raise InvalidInput(
                        f"ConvProblem field {name!r} ({getattr(self, name)}) belongs to a depth axis, "
                        f"which a 2-D problem lacks; give d (the input depth) for a 3-D problem"
                    )
        if self.c % self.groups or self.k % self.groups:
            raise InvalidInput(f"ConvProblem field 'groups' ({self.groups}) must divide c ({self.c}) and k ({self.k})")
        self._check_output_padding()
        axes = self.axes
        if any(a.out < 1 for a in axes):
            outs = "x".join(str(a.out) for a in axes)
            if self.transposed:
                raise InvalidInput(
                    f"ConvProblem transposed output would be {outs}: (size - 1) * stride - 2 * pad + dilated filter "
                    f"+ output_padding is below 1 on axis {next(a.name for a in axes if a.out < 1)}; "
                    f"use less padding"
                )
            raise InvalidInput(
                f"ConvProblem output would be {outs}: the dilated filter "
                f"({'x'.join(str(a.dilated) for a in axes)}) is larger than the padded input "
                f"({'x'.join(str(a.size + 2 * a.pad) for a in axes)})"
            )

    def _check_output_padding(self) -> None:
        for _, _, _, stride, dilation, padding in _AXIS_FIELDS.values():
            value = getattr(self, padding)
            if not value:
                continue
            if not self.transposed:
                raise InvalidInput(
                    f"ConvProblem field {padding!r} ({value}) applies to transposed convolutions "
                    f"only; set transposed (transposed=1 in a spec) or leave it out"
                )
            st, dil = getattr(self, stride), getattr(self, dilation)
            if value >= max(st, dil):
                raise InvalidInput(
                    f"ConvProblem field {padding!r} ({value}) must be smaller than {stride} ({st}) "
                    f"or {dilation} ({dil}), as PyTorch requires"
                )
            if value >= st:
                raise InvalidInput(
                    f"ConvProblem field {padding!r} ({value}) is not below {stride} ({st}): ucudnn "
                    f"runs a transposed convolution as a convolution's kernels, which cannot "
                    f"express it; use an output padding below the stride"
                )

    # ---- derived sizes ------------------------------------------------------------------
    @property
    def spatial_dims(self) -> int:
        """2 or 3 (a 1-D problem is a 2-D one of height 1)."""
        return 3 if self.d else 2

    @property
    def axes(self) -> tuple[Axis, ...]:
        """The spatial axes, outermost first: (d, h, w) in 3-D, (h, w) in 2-D."""
        transposed = self.transposed
        h = Axis(
            "h",
            self.h,
            self.r,
            self.pad_h,
            self.stride_h,
            self.dilation_h,
            self.output_padding_h,
            _out_size(self.h, self.r, self.pad_h, self.stride_h, self.dilation_h, self.output_padding_h, transposed),
        )
        w = Axis(
            "w",
            self.w,
            self.s,
            self.pad_w,
            self.stride_w,
            self.dilation_w,
            self.output_padding_w,
            _out_size(self.w, self.s, self.pad_w, self.stride_w, self.dilation_w, self.output_padding_w, transposed),
        )
        if not self.d:
            return (h, w)
        return (
            Axis("d", self.d, self.t, self.pad_d, self.stride_d, self.dilation_d, self.output_padding_d, self.out_d),
            h,
            w,
        )

    @property
    def dilated_r(self) -> int:
        return (self.r - 1) * self.dilation_h + 1

    @property
    def dilated_s(self) -> int:
        return (self.s - 1) * self.dilation_w + 1

    @property
    def dilated_t(self) -> int:
        return (self.t - 1) * self.dilation_d + 1

    @property
    def out_h(self) -> int:
        return _out_size(
            self.h, self.r, self.pad_h, self.stride_h, self.dilation_h, self.output_padding_h, self.transposed
        )

    @property
    def out_w(self) -> int:
        return _out_size(
            self.w, self.s, self.pad_w, self.stride_w, self.dilation_w, self.output_padding_w, self.transposed
        )

    @property
    def out_d(self) -> int:
        """y's depth; 0 for a 2-D problem (as its d)."""
        if not self.d:
            return 0
        return _out_size(
            self.d, self.t, self.pad_d, self.stride_d, self.dilation_d, self.output_padding_d, self.transposed
        )

    @property
    def x_shape(self) -> tuple[int, ...]:
        return (self.n, self.c, *(a.size for a in self.axes))

    @property
    def w_shape(self) -> tuple[int, ...]:
        """(k, c/groups, [t,] r, s); transposed: (c, k/groups, [t,] r, s), as ConvTranspose holds it."""
        filters = tuple(a.filter for a in self.axes)
        if self.transposed:
            return (self.c, self.k // self.groups, *filters)
        return (self.k, self.c // self.groups, *filters)

    @property
    def y_shape(self) -> tuple[int, ...]:
        return (self.n, self.k, *(a.out for a in self.axes))

    @property
    def out_shape(self) -> tuple[int, ...]:
        """Shape of what this kind writes: y for fwd, dx for bwd_data, dw for bwd_filter."""
        return {"fwd": self.y_shape, "bwd_data": self.x_shape, "bwd_filter": self.w_shape}[self.kind]

    @property
    def effective_compute_type(self) -> str:
        return self.compute_type or self.dtype

    @property
    def flops(self) -> int:
        """Multiply-adds x 2 of one kernel (the same count for all three kinds)."""
        if self.transposed:
            return self.lowered().flops
        taps = math.prod(a.filter for a in self.axes)
        return 2 * self.n * self.k * math.prod(a.out for a in self.axes) * (self.c // self.groups) * taps

    # ---- variants -----------------------------------------------------------------------
    def with_batch(self, n: int) -> ConvProblem:
        return dataclasses.replace(self, n=n)

    def with_kind(self, kind: str) -> ConvProblem:
        return dataclasses.replace(self, kind=kind)

    def lowered(self) -> ConvProblem:
        """The ordinary convolution's kernel that computes this one: itself unless transposed.

        A transposed convolution of x (n, c, sizes) into y (n, k, outs) is the adjoint of the
        convolution of y into x: input channels k, output channels c, input extents `outs`, the same
        filter (c, k/groups, ...) read as (K, C/groups, ...), padding, stride, dilation and groups. Its
        kind is `LOWERED_KIND[kind]`, and the operands change roles: this problem's x is the lowered
        one's dy, its dy the lowered x (w and the output keep theirs). The lowered convolution's
        output extents are exactly `sizes` because output_padding < stride (checked on construction).
        """
        if not self.transposed:
            return self
        outs = {a.name: a.out for a in self.axes}
        return dataclasses.replace(
            self,
            kind=LOWERED_KIND[self.kind],
            c=self.k,
            k=self.c,
            h=outs["h"],
            w=outs["w"],
            d=outs.get("d", 0),
            transposed=False,
            output_padding_h=0,
            output_padding_w=0,
            output_padding_d=0,
        )

    # ---- text forms ---------------------------------------------------------------------
    @property
    def key(self) -> str:
        """Canonical text of every field except `n` (the cache stores the batch size apart).

        The first release's fields always, in their order; later ones (depth, transposed, output
        padding) only when not at their defaults, so that 2-D keys stay byte-identical. `parse`
        reads a key back.
        """
        parts = []
        for f in dataclasses.fields(self):
            name, value = f.name, getattr(self, f.name)
            if name == "n" or (name in _LATER_FIELDS and value == f.default):
                continue
            if name == "compute_type":
                value = self.effective_compute_type  # "" and the dtype mean the same
            elif name == "transposed":
                value = int(value)
            parts.append(f"{name}={value}")
        return ",".join(parts)

    @property
    def spec(self) -> str:
        """Short human form that `parse` reads back (defaults left out)."""
        axes = [a.name for a in self.axes]
        parts = [
            f"n={self.n}",
            f"c={self.c}",
            *(f"{a}={getattr(self, a)}" for a in axes),
            f"k={self.k}",
            *(f"{_AXIS_FIELDS[a][1]}={getattr(self, _AXIS_FIELDS[a][1])}" for a in axes),
        ]
        if self.transposed:
            parts.append("transposed=1")
        for position, both in enumerate(_ALL_AXES, start=2):
            names = [_AXIS_FIELDS[a][position] for a in axes]
            values = [getattr(self, name) for name in names]
            if len(set(values)) == 1:
                if values[0] != _DEFAULTS[names[0]]:
                    parts.append(f"{both}={values[0]}")
            else:
                parts += [f"{name}={value}" for name, value in zip(names, values)]
        for name in ("groups", "dtype", "compute_type", "layout", "kind"):
            if getattr(self, name) != _DEFAULTS[name]:
                parts.append(f"{name}={getattr(self, name)}")
        return ",".join(parts)

    @classmethod
    def parse(cls, spec: str, *, unused: Mapping[str, str] | None = None) -> ConvProblem:
        """Read `"n=32,c=64,h=56,w=56,k=128,r=3,s=3,pad=1,stride=1"` (or a `key`).

        `d=` (input depth) makes the problem 3-D, with `t=` its filter depth. `pad`, `stride`,
        `dilation` and `output_padding` set every axis the problem has; `pad_h`, `stride_d`,
        `output_padding_w`, ... set one. `transposed=1` makes it a transposed convolution. `n`
        defaults to 1 and `kind` to `fwd`; `c, h, w, k, r, s` are required. `unused` maps keys the
        caller would ignore to why (`{"kind": "it runs the kinds of --kinds"}`): such a key is
        refused, not silently dropped. Every refusal of a key names the keys taken.
        """
        if not isinstance(spec, str) or not spec.strip():
            raise InvalidInput("layer spec is empty; expected e.g. 'n=32,c=64,h=56,w=56,k=128,r=3,s=3,pad=1'")
        unused = dict(unused or {})
        taken = ", ".join(k for k in SPEC_KEYS if k not in unused)
        items = []
        for item in spec.split(","):
            item = item.strip()
            if not item:
                continue
            key, eq, raw = item.partition("=")
            key, raw = key.strip(), raw.strip()
            if not eq or not raw:
                raise InvalidInput(f"layer spec {spec!r}: {item!r} is not of the form key=value")
            if key in unused:
                raise InvalidInput(
                    f"layer spec {spec!r}: the key {key!r} is not used here ({unused[key]}); keys taken: {taken}"
                )
            if key not in SPEC_KEYS:
                raise InvalidInput(f"layer spec {spec!r}: unknown key {key!r}; keys taken: {taken}")
            items.append((key, raw))
        axes = ("d", "h", "w") if any(key == "d" for key, _ in items) else ("h", "w")
        values: dict[str, int | str | bool] = {}
        for key, raw in items:
            targets = tuple(f"{key}_{a}" for a in axes) if key in _ALL_AXES else (key,)
            if key == "transposed":
                if raw not in ("0", "1"):
                    raise InvalidInput(f"layer spec {spec!r}: transposed must be 0 or 1, got {raw!r}")
                value: int | str | bool = raw == "1"
            elif targets[0] in _INT_FIELDS:
                try:
                    value = int(raw)
                except ValueError:
                    raise InvalidInput(f"layer spec {spec!r}: {key} must be an integer, got {raw!r}") from None
            else:
                value = raw
            if key == "d" and value == 0:
                raise InvalidInput(f"layer spec {spec!r}: d must be positive (leave d out for a 2-D problem)")
            for target in targets:
                if target in values:
                    raise InvalidInput(f"layer spec {spec!r}: {target} is given twice")
                values[target] = value
        missing = [name for name in _REQUIRED if name not in values]
        if missing:
            raise InvalidInput(f"layer spec {spec!r}: missing {', '.join(missing)}")
        try:
            return cls(**values)  # type: ignore[arg-type]
        except InvalidInput as exc:  # in the spec's words: the key as written (pad, not pad_h)
            written = {
                target: key
                for key, _ in items
                for target in (tuple(f"{key}_{a}" for a in axes) if key in _ALL_AXES else (key,))
            }
            raise InvalidInput(f"layer spec {spec!r}: {_in_spec_words(str(exc), written)}") from None

    @classmethod
    def from_shapes(
        cls,
        x_shape: Sequence[int],
        w_shape: Sequence[int],
        *,
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        transposed: bool = False,
        output_padding: int | Sequence[int] = 0,
        kind: str = "fwd",
        dtype: str = "float32",
        compute_type: str = "",
        layout: str = "NCHW",
    ) -> ConvProblem:
        """The problem of a PyTorch convolution, from its input's and weight's shapes and arguments.

        x (n, c, l), (n, c, h, w) or (n, c, d, h, w) for Conv1d/2d/3d and ConvTranspose1d/2d/3d; the
        weight as the module holds it ((out, in/groups, ...) plain, (in, out/groups, ...) transposed);
        `stride`, `padding`, `dilation` and `output_padding` an int or one value per spatial axis, as
        PyTorch takes them. A 1-D convolution becomes the 2-D problem of height 1 (h=1, r=1, pad_h=0).
        """
        x_shape, w_shape = tuple(x_shape), tuple(w_shape)
        dims = len(x_shape) - 2
        if dims not in (1, 2, 3) or len(w_shape) != len(x_shape):
            raise InvalidInput(
                f"x {x_shape} and w {w_shape} must both have 3, 4 or 5 dimensions "
                f"(batch, channels, then 1 to 3 spatial axes)"
            )

        def per_axis(name: str, value: int | Sequence[int]) -> tuple[int, ...]:
            values = (value,) * dims if isinstance(value, int) else tuple(value)
            if len(values) != dims:
                raise InvalidInput(f"{name} {value!r} must be an int or {dims} values, one per spatial axis")
            return values

        st, pad, dil, opad = (
            per_axis(name, value)
            for name, value in (
                ("stride", stride),
                ("padding", padding),
                ("dilation", dilation),
                ("output_padding", output_padding),
            )
        )
        sizes, filters = x_shape[2:], w_shape[2:]
        if dims == 1:  # a 2-D problem of height 1
            sizes, filters, st, pad, dil, opad = (
                (1, *sizes),
                (1, *filters),
                (1, *st),
                (0, *pad),
                (1, *dil),
                (0, *opad),
            )
        weight_in = w_shape[0] if transposed else w_shape[1] * groups
        if weight_in != x_shape[1]:
            held = "(in, out/groups, ...)" if transposed else "(out, in/groups, ...)"
            raise InvalidInput(
                f"w {w_shape} does not take the {x_shape[1]} channels of x {x_shape} with "
                f"groups={groups}; a {'transposed ' if transposed else ''}convolution's weight is "
                f"{held}"
            )
        out_channels = w_shape[1] * groups if transposed else w_shape[0]
        fields: dict[str, int] = {}
        for axis, size, filter_, s, p, dl, op in zip(
            ("d", "h", "w")[-len(sizes) :], sizes, filters, st, pad, dil, opad
        ):
            names = _AXIS_FIELDS[axis]
            fields.update({names[0]: size, names[1]: filter_, names[2]: p, names[3]: s, names[4]: dl, names[5]: op})
        return cls(
            kind=kind,
            n=x_shape[0],
            c=x_shape[1],
            k=out_channels,
            groups=groups,
            transposed=transposed,
            dtype=dtype,
            compute_type=compute_type,
            layout=layout,
            **fields,
        )


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ConvProblem)}
