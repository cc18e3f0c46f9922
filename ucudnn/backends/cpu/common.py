"""The element moves every CPU family shares: reading an image through padding, stride and dilation,
adding back into one (over any number of spatial axes), and the alpha/beta blend into the caller's
output. The families run ordinary convolutions only: a transposed problem reaches them lowered
(`ConvProblem.lowered`), with x and dy swapped by the backend."""

from __future__ import annotations

import itertools

import numpy as np

from ucudnn.problem import ConvProblem


def _valid(count: int, length: int, step: int, offset: int) -> tuple[int, int, int]:
    """Indices p in [lo, hi) of `count` with 0 <= offset + p * step < length, and that first index."""
    lo = max(0, -(offset // step))
    hi = min(count, (length - 1 - offset) // step + 1)
    if hi <= lo:
        return 0, 0, 0
    return lo, hi, offset + lo * step


_ALL = slice(None)


def _ranges(
    dst_shape: tuple[int, ...], src_shape: tuple[int, ...], moves: tuple[tuple[int, int], ...], images_are_src: bool
) -> list[tuple[int, int, int, int]] | None:
    """(lo, hi, first, step) per trailing axis: the indices of the moved array that land inside the
    image, the first image index they read, and the step; None when none does on some axis."""
    moved, image = (dst_shape, src_shape) if images_are_src else (src_shape, dst_shape)
    ranges = []
    for i, (step, offset) in enumerate(moves, start=-len(moves)):
        lo, hi, first = _valid(moved[i], image[i], step, offset)
        if lo == hi:
            return None
        ranges.append((lo, hi, first, step))
    return ranges


def _gather_plan(dst_shape: tuple[int, ...], src_shape: tuple[int, ...], moves, prefix: tuple = ()):
    """`_gather` as index tuples, made once per shape: (dst indices to zero, the dst index written, the src
    index read; the last two None where nothing of src is read). `prefix` indexes dst before its
    `dst_shape` part (a filter tap of im2col's columns)."""
    ranges = _ranges(dst_shape, src_shape, moves, True)
    if ranges is None:
        return [prefix + (Ellipsis,)], None, None
    count = len(moves)
    zeros = []
    inside: tuple = prefix + (Ellipsis,)
    reads: tuple = (Ellipsis,)
    for i, (lo, hi, first, step) in enumerate(ranges):  # axis i's border, inside the axes before it
        rest = (_ALL,) * (count - i - 1)
        if lo:
            zeros.append(inside + (slice(None, lo),) + rest)
        if hi < dst_shape[i - count]:
            zeros.append(inside + (slice(hi, None),) + rest)
        inside += (slice(lo, hi),)
        reads += (slice(first, first + (hi - lo - 1) * step + 1, step),)
    return zeros, inside, reads


def _run_gather(dst: np.ndarray, src: np.ndarray, plan) -> None:
    """One `_gather_plan`: only the border that falls outside `src` is zeroed, so each element of `dst`
    is written once."""
    zeros, inside, reads = plan
    for index in zeros:
        dst[index] = 0
    if inside is not None:
        np.copyto(dst[inside], src[reads])


def _gather(dst: np.ndarray, src: np.ndarray, *moves: tuple[int, int]) -> None:
    """dst[..., p, q] = src[..., p * rows[0] + rows[1], q * cols[0] + cols[1]], zero outside src.

    One (step, offset) move per trailing axis, as many as the problem has spatial axes (rows and
    columns in 2-D, depth first in 3-D). Only the border that falls outside `src` is zeroed, so each
    element of `dst` is written once.
    """
    _run_gather(dst, src, _gather_plan(dst.shape, src.shape, moves))


def _scatter_plan(dst_shape: tuple[int, ...], src_shape: tuple[int, ...], moves, prefix: tuple = ()):
    """`_scatter_add` as index tuples, made once per shape: (the dst index added to, the src index read),
    or None where nothing lands inside dst. `prefix` indexes src before its `src_shape` part."""
    ranges = _ranges(dst_shape, src_shape, moves, False)
    if ranges is None:
        return None
    return (
        (Ellipsis, *(slice(first, first + (hi - lo - 1) * step + 1, step) for lo, hi, first, step in ranges)),
        prefix + (Ellipsis, *(slice(lo, hi) for lo, hi, _, _ in ranges)),
    )


def _scatter_add(dst: np.ndarray, src: np.ndarray, *moves: tuple[int, int]) -> None:
    """dst[..., p * rows[0] + rows[1], q * cols[0] + cols[1]] += src[..., p, q] where inside dst
    (one (step, offset) move per trailing axis, as `_gather`)."""
    plan = _scatter_plan(dst.shape, src.shape, moves)
    if plan is not None:
        target = dst[plan[0]]
        np.add(target, src[plan[1]], out=target)


def _tap_moves(p: ConvProblem) -> list[tuple[tuple[int, ...], list[tuple[int, int]]]]:
    """Every filter tap, as an index per spatial axis in the filter's memory order, with the
    (stride, offset) per axis at which it reads the unpadded image."""
    axes = p.axes
    return [
        (tap, [(a.stride, m * a.dilation - a.pad) for m, a in zip(tap, axes)])
        for tap in itertools.product(*(range(a.filter) for a in axes))
    ]


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
