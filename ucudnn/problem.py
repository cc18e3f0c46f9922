"""`ConvProblem`: one convolution kernel, as a frozen value with a canonical text key."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from ucudnn.errors import InvalidInput

KINDS = ("fwd", "bwd_data", "bwd_filter")
DTYPES = ("float32", "float64", "float16", "bfloat16")
LAYOUTS = ("NCHW", "NHWC")

# Spec keys that set both axes at once.
_BOTH_AXES = {"pad": ("pad_h", "pad_w"), "stride": ("stride_h", "stride_w"),
              "dilation": ("dilation_h", "dilation_w")}
_INT_FIELDS = ("n", "c", "h", "w", "k", "r", "s", "pad_h", "pad_w", "stride_h", "stride_w",
               "dilation_h", "dilation_w", "groups")
_REQUIRED = ("c", "h", "w", "k", "r", "s")
# Every key `ConvProblem.parse` reads, in the order a person writes them.
SPEC_KEYS = ("n", "c", "h", "w", "k", "r", "s", "pad", "pad_h", "pad_w", "stride", "stride_h", "stride_w",
             "dilation", "dilation_h", "dilation_w", "groups", "dtype", "compute_type", "layout", "kind")


@dataclass(frozen=True, slots=True)
class ConvProblem:
    """A 2-D convolution kernel: input `x` is (n, c, h, w), filter `w` is (k, c/groups, r, s).

    `kind` names which of the three kernels this is: `fwd` (x, w -> y), `bwd_data` (dy, w -> dx)
    or `bwd_filter` (x, dy -> dw). Every field is validated on construction.
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

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidInput(f"ConvProblem field {name!r} must be an integer, got {value!r}")
            minimum = 0 if name in ("pad_h", "pad_w") else 1
            if value < minimum:
                rule = "non-negative" if minimum == 0 else "positive"
                raise InvalidInput(f"ConvProblem field {name!r} must be {rule}, got {value}")
        if self.kind not in KINDS:
            raise InvalidInput(f"ConvProblem field 'kind' must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.dtype not in DTYPES:
            raise InvalidInput(f"ConvProblem field 'dtype' must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.compute_type and self.compute_type not in DTYPES:
            raise InvalidInput(
                f"ConvProblem field 'compute_type' must be one of {', '.join(DTYPES)}, got {self.compute_type!r}")
        if self.layout not in LAYOUTS:
            raise InvalidInput(f"ConvProblem field 'layout' must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.c % self.groups or self.k % self.groups:
            raise InvalidInput(f"ConvProblem field 'groups' ({self.groups}) must divide c ({self.c}) and k ({self.k})")
        if self.out_h < 1 or self.out_w < 1:
            raise InvalidInput(
                f"ConvProblem output would be {self.out_h}x{self.out_w}: the dilated filter "
                f"({self.dilated_r}x{self.dilated_s}) is larger than the padded input "
                f"({self.h + 2 * self.pad_h}x{self.w + 2 * self.pad_w})")

    # ---- derived sizes ------------------------------------------------------------------
    @property
    def dilated_r(self) -> int:
        return (self.r - 1) * self.dilation_h + 1

    @property
    def dilated_s(self) -> int:
        return (self.s - 1) * self.dilation_w + 1

    @property
    def out_h(self) -> int:
        return (self.h + 2 * self.pad_h - self.dilated_r) // self.stride_h + 1

    @property
    def out_w(self) -> int:
        return (self.w + 2 * self.pad_w - self.dilated_s) // self.stride_w + 1

    @property
    def x_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.c, self.h, self.w)

    @property
    def w_shape(self) -> tuple[int, int, int, int]:
        return (self.k, self.c // self.groups, self.r, self.s)

    @property
    def y_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.k, self.out_h, self.out_w)

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        """Shape of what this kind writes: y for fwd, dx for bwd_data, dw for bwd_filter."""
        return {"fwd": self.y_shape, "bwd_data": self.x_shape, "bwd_filter": self.w_shape}[self.kind]

    @property
    def effective_compute_type(self) -> str:
        return self.compute_type or self.dtype

    @property
    def flops(self) -> int:
        """Multiply-adds x 2 of one kernel (the same count for all three kinds)."""
        return 2 * self.n * self.k * self.out_h * self.out_w * (self.c // self.groups) * self.r * self.s

    # ---- variants -----------------------------------------------------------------------
    def with_batch(self, n: int) -> ConvProblem:
        return dataclasses.replace(self, n=n)

    def with_kind(self, kind: str) -> ConvProblem:
        return dataclasses.replace(self, kind=kind)

    # ---- text forms ---------------------------------------------------------------------
    @property
    def key(self) -> str:
        """Canonical text of every field except `n` (the cache stores the batch size apart)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "n"}
        values["compute_type"] = self.effective_compute_type  # "" and the dtype mean the same
        return ",".join(f"{name}={value}" for name, value in values.items())

    @property
    def spec(self) -> str:
        """Short human form that `parse` reads back (defaults left out)."""
        default = ConvProblem()
        parts = [f"n={self.n}", f"c={self.c}", f"h={self.h}", f"w={self.w}", f"k={self.k}",
                 f"r={self.r}", f"s={self.s}"]
        for both, (a, b) in _BOTH_AXES.items():
            va, vb = getattr(self, a), getattr(self, b)
            if va == vb:
                if va != getattr(default, a):
                    parts.append(f"{both}={va}")
            else:
                parts += [f"{a}={va}", f"{b}={vb}"]
        for name in ("groups", "dtype", "compute_type", "layout"):
            if getattr(self, name) != getattr(default, name):
                parts.append(f"{name}={getattr(self, name)}")
        if self.kind != default.kind:
            parts.append(f"kind={self.kind}")
        return ",".join(parts)

    @classmethod
    def parse(cls, spec: str, *, unused: Mapping[str, str] | None = None) -> ConvProblem:
        """Read `"n=32,c=64,h=56,w=56,k=128,r=3,s=3,pad=1,stride=1"`.

        `pad`, `stride` and `dilation` set both axes; `pad_h`, `stride_w`, ... set one. `n` defaults
        to 1 and `kind` to `fwd`; `c, h, w, k, r, s` are required. `unused` maps keys the caller
        would ignore to why (`{"kind": "it runs the kinds of --kinds"}`): such a key is refused, not
        silently dropped. Every refusal of a key names the keys taken.
        """
        if not isinstance(spec, str) or not spec.strip():
            raise InvalidInput("layer spec is empty; expected e.g. 'n=32,c=64,h=56,w=56,k=128,r=3,s=3,pad=1'")
        unused = dict(unused or {})
        taken = ", ".join(k for k in SPEC_KEYS if k not in unused)
        values: dict[str, int | str] = {}
        for item in spec.split(","):
            item = item.strip()
            if not item:
                continue
            key, eq, raw = item.partition("=")
            key, raw = key.strip(), raw.strip()
            if not eq or not raw:
                raise InvalidInput(f"layer spec {spec!r}: {item!r} is not of the form key=value")
            targets = _BOTH_AXES.get(key, (key,))
            if key in unused:
                raise InvalidInput(f"layer spec {spec!r}: the key {key!r} is not used here ({unused[key]}); "
                                   f"keys taken: {taken}")
            if key not in SPEC_KEYS:
                raise InvalidInput(f"layer spec {spec!r}: unknown key {key!r}; keys taken: {taken}")
            if targets[0] in _INT_FIELDS:
                try:
                    value: int | str = int(raw)
                except ValueError:
                    raise InvalidInput(f"layer spec {spec!r}: {key} must be an integer, got {raw!r}") from None
            else:
                value = raw
            for target in targets:
                if target in values:
                    raise InvalidInput(f"layer spec {spec!r}: {target} is given twice")
                values[target] = value
        missing = [name for name in _REQUIRED if name not in values]
        if missing:
            raise InvalidInput(f"layer spec {spec!r}: missing {', '.join(missing)}")
        return cls(**values)  # type: ignore[arg-type]
