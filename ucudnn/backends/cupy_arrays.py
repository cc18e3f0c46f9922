"""Arithmetic on CuPy arrays of every dtype the cudnn backend stores, bfloat16 held as uint16 bits
included (CuPy has none): widening, narrowing, and the fused alpha/beta blend that cuDNN's graph API
(alpha = 1, beta = 0) leaves to us."""

from __future__ import annotations

import functools
from typing import Any


def _storage_dtype(cupy: Any, dtype: str) -> Any:
    # CuPy 14 has no bfloat16: such tensors live in uint16 arrays holding the bits, which is all
    # the frontend reads (it takes raw pointers and the graph's declared type).
    return {"float32": cupy.float32, "float16": cupy.float16, "float64": cupy.float64, "bfloat16": cupy.uint16}[dtype]


def _widen(cupy: Any, array: Any, dtype: str) -> Any:
    """float32 (float64 for float64) values of an array of `dtype`."""
    if dtype == "bfloat16":
        return (array.astype(cupy.uint32) << 16).view(cupy.float32)
    return array.astype(cupy.float64 if dtype == "float64" else cupy.float32)


def _narrow(cupy: Any, values: Any, dtype: str) -> Any:
    """`values` (float32 or float64) in the storage of `dtype`, rounding to nearest even."""
    if dtype == "bfloat16":
        bits = values.astype(cupy.float32).view(cupy.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(cupy.uint16)
    return values.astype(_storage_dtype(cupy, dtype))


# The arithmetic type of the blend, by storage dtype (bfloat16 has no CuPy type: see `blend`).
_ARITHMETIC = {"float16": ("float32", "float"), "float32": ("float32", "float"), "float64": ("float64", "double")}


def blend_kernel_sources(dtype: str) -> dict[str, tuple[str, str, str]]:
    """(in_params, out_params, operation) of the scale and blend kernels for `dtype`'s data.

    CuPy fills a type placeholder (`T`) only from the arrays it is given, never from a scalar
    (CuPy issue #2091): the scalars alpha and beta therefore carry a concrete type, the arithmetic
    type of the data (float32, float64 for float64), and only the arrays use `T`.
    """
    wide, ctype = _ARITHMETIC[dtype]
    return {
        "scale": (f"T tmp, {wide} alpha", "T out", f"out = (T)(alpha * ({ctype})tmp)"),
        "blend": (
            f"T tmp, {wide} alpha, {wide} beta",
            "T out",
            f"out = (T)(alpha * ({ctype})tmp + beta * ({ctype})out)",
        ),
    }


@functools.cache
def _blend_kernels(cupy: Any, dtype: str) -> tuple[Any, Any]:
    """(scale, blend) elementwise kernels for `dtype`'s data: out = alpha * tmp, and out = alpha *
    tmp + beta * out. Scaling is its own kernel so that beta = 0 never reads `out`, which may hold NaN."""
    sources = blend_kernel_sources(dtype)
    wide = _ARITHMETIC[dtype][0]
    return tuple(cupy.ElementwiseKernel(*sources[name], f"ucudnn_{name}_{wide}") for name in ("scale", "blend"))


def blend(cupy: Any, dtype: str, target: Any, out: Any, alpha: float, beta: float) -> None:
    """out = alpha * target + beta * out in one fused kernel; beta = 0 never reads `out`.

    bfloat16 (uint16 bits, no arithmetic type for a fused kernel) goes through float32 arrays.
    """
    if dtype == "bfloat16":
        blended = _widen(cupy, target, dtype) * alpha
        if beta != 0.0:
            blended += beta * _widen(cupy, out, dtype)
        out[...] = _narrow(cupy, blended, dtype)
        return
    wide = cupy.float64 if dtype == "float64" else cupy.float32
    scale, fused = _blend_kernels(cupy, dtype)
    if beta == 0.0:
        scale(target, wide(alpha), out)
    else:
        fused(target, wide(alpha), wide(beta), out)
