"""The element moves every CPU family shares: reading an image through padding, stride and dilation,
adding back into one, and the alpha/beta blend into the caller's output."""

from __future__ import annotations

import numpy as np


def _valid(count: int, length: int, step: int, offset: int) -> tuple[int, int, int]:
    """Indices p in [lo, hi) of `count` with 0 <= offset + p * step < length, and that first index."""
    lo = max(0, -(offset // step))
    hi = min(count, (length - 1 - offset) // step + 1)
    if hi <= lo:
        return 0, 0, 0
    return lo, hi, offset + lo * step


def _gather(dst: np.ndarray, src: np.ndarray, rows: tuple[int, int], cols: tuple[int, int]) -> None:
    """dst[..., p, q] = src[..., p * rows[0] + rows[1], q * cols[0] + cols[1]], zero outside src.

    Only the border that falls outside `src` is zeroed, so each element of `dst` is written once.
    """
    p_lo, p_hi, a = _valid(dst.shape[-2], src.shape[-2], *rows)
    q_lo, q_hi, b = _valid(dst.shape[-1], src.shape[-1], *cols)
    if p_lo == p_hi or q_lo == q_hi:
        dst[...] = 0
        return
    dst[..., :p_lo, :] = 0
    dst[..., p_hi:, :] = 0
    dst[..., p_lo:p_hi, :q_lo] = 0
    dst[..., p_lo:p_hi, q_hi:] = 0
    np.copyto(dst[..., p_lo:p_hi, q_lo:q_hi],
              src[..., a:a + (p_hi - p_lo - 1) * rows[0] + 1:rows[0],
                  b:b + (q_hi - q_lo - 1) * cols[0] + 1:cols[0]])


def _scatter_add(dst: np.ndarray, src: np.ndarray, rows: tuple[int, int], cols: tuple[int, int]) -> None:
    """dst[..., p * rows[0] + rows[1], q * cols[0] + cols[1]] += src[..., p, q] where inside dst."""
    p_lo, p_hi, a = _valid(src.shape[-2], dst.shape[-2], *rows)
    q_lo, q_hi, b = _valid(src.shape[-1], dst.shape[-1], *cols)
    if p_lo == p_hi or q_lo == q_hi:
        return
    target = dst[..., a:a + (p_hi - p_lo - 1) * rows[0] + 1:rows[0], b:b + (q_hi - q_lo - 1) * cols[0] + 1:cols[0]]
    np.add(target, src[..., p_lo:p_hi, q_lo:q_hi], out=target)


def _blend(out: np.ndarray, value: np.ndarray, alpha: float, beta: float) -> None:
    """out = alpha * value + beta * out; `value` lives in the workspace and may be scaled in place.

    beta == 0 never reads `out`, so garbage or NaN there does not leak into the result.
    """
    if beta == 0.0:
        if alpha == 1.0:
            np.copyto(out, value)
        else:
            np.multiply(value, alpha, out=out)
        return
    if alpha != 1.0:
        np.multiply(value, alpha, out=value)
    if beta != 1.0:
        np.multiply(out, beta, out=out)
    np.add(out, value, out=out)


def _scale_out(out: np.ndarray, beta: float) -> None:
    """out = beta * out before accumulating into it (beta == 0 clears it without reading)."""
    if beta == 0.0:
        out[...] = 0
    elif beta != 1.0:
        np.multiply(out, beta, out=out)
