"""Arithmetic on CuPy arrays of every dtype the cudnn backend stores, bfloat16 held as uint16 bits
included (CuPy has none): widening, narrowing, and the fused alpha/beta blend that cuDNN's graph API
(alpha = 1, beta = 0) leaves to us."""

from __future__ import annotations

import functools
from typing import Any


def _storage_dtype(cupy: Any, dtype: str) -> Any:
    # CuPy 14 has no bfloat16: such tensors live in uint16 arrays holding the bits, which is all
    # the frontend reads (it takes raw pointers and the graph's declared type).
    return {"float32": cupy.float32, "float16": cupy.float16, "float64": cupy.float64,
            "bfloat16": cupy.uint16}[dtype]


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


@functools.cache
def _blend_kernels() -> tuple[Any, Any]:
    """(scale, blend) elementwise kernels: out = alpha * tmp, and out = alpha * tmp + beta * out.

    W is the arithmetic type (float32, float64 for float64 data); T the storage type. Scaling is
    its own kernel so that beta = 0 never reads `out`, which may hold NaN.
    """
    import cupy

    scale = cupy.ElementwiseKernel("T tmp, W alpha", "T out", "out = (T)(alpha * (W)tmp)", "ucudnn_scale")
    blend = cupy.ElementwiseKernel("T tmp, W alpha, W beta", "T out", "out = (T)(alpha * (W)tmp + beta * (W)out)",
                                   "ucudnn_blend")
    return scale, blend
