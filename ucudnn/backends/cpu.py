"""`cpu`: convolution algorithms over NumPy and SciPy, plus PyTorch's own as `native`.

Every algorithm except `native` takes each temporary it needs (unfolded columns, padded copies,
FFT spectra, DFT matrices, Winograd transforms, GEMM results before alpha/beta scaling) as a view
of the workspace buffer it is given and writes through `out=` arguments, so `workspace_size` is
the memory the algorithm really uses. (What stays outside: Python objects, index vectors as long
as one side of an FFT grid, and NumPy's bounded ufunc buffers.) `workspace_size` and `run` read
one description of the buffer (a `_Layout` per algorithm and kind), so the two cannot drift apart.

Notation: x (n, c, h, w), filter (k, c/g, r, s), y (n, k, oh, ow), g groups, P = oh * ow.

- `im2col_gemm`: unfold the padded input of the whole micro-batch into a (c r s) x (n P) column
  matrix and run one GEMM per group. Workspace grows linearly with n.
- `shift_gemm`: one GEMM per filter offset (i, j), accumulating in BLAS (beta = 1), one sample
  at a time. Workspace is one shifted input slab and a filter copy, independent of n.
- `fft`: real FFTs of the images, exact DFTs of the filter taps, a complex GEMM per frequency
  that sums over channels, inverse FFTs. Padding, stride and dilation are where samples are
  placed on the FFT grid, so every problem is supported. Workspace grows linearly with n.
- `winograd`: F(2x2, 3x3) for 3x3, stride-1, undilated filters, all three kinds. Workspace
  grows linearly with n.
- `native`: torch.nn.functional.conv2d and torch.nn.grad, listed only when torch imports.

Threads: by default BLAS and `scipy.fft` use every core. ``CpuBackend(numpy_threads=1)`` runs the
NumPy algorithms on one thread (BLAS through `threadpoolctl`, FFTs through ``scipy.fft.set_workers``),
for callers that run them between PyTorch's own operations: two thread pools that spin while
waiting take turns on the same cores, and a training step through both ran 2.5-5x slower than
PyTorch alone on 2 cores. The setting is part of each measurement's key, so timings taken under
one setting never stand in for the other.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy
import scipy.fft
from scipy.linalg import blas as scipy_blas

from ucudnn.backends.base import Backend, DeviceInfo, wall_clock_samples_ms
from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.problem import ConvProblem

IM2COL_GEMM = "im2col_gemm"
SHIFT_GEMM = "shift_gemm"
FFT = "fft"
WINOGRAD = "winograd"
NATIVE = "native"
ALGORITHMS = (IM2COL_GEMM, SHIFT_GEMM, FFT, WINOGRAD)  # `native` is added when torch imports

SUPPORTED_DTYPES = ("float32", "float64")

# Every array carved from a workspace starts on a 64-byte boundary (a cache line, and the widest
# SIMD load), measured from the buffer's real address; the declared size carries 64 bytes of slack
# for that, so a caller's buffer at any address still fits. NumPy hands only aligned arrays to BLAS.
ALIGN_BYTES = 64


# ---- workspace layout ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Slot:
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


class _Layout:
    """Named arrays at fixed byte offsets of one workspace buffer.

    `add` places arrays one after another; `overlay` places several alternative groups at the same
    offset, for temporaries whose lifetimes do not overlap (each group is laid out in sequence).
    """

    def __init__(self) -> None:
        self.slots: dict[str, _Slot] = {}
        self.end = 0

    def _place(self, start: int, items: Sequence[tuple[str, tuple[int, ...], Any]]) -> int:
        offset = start
        for name, shape, dtype in items:
            if name in self.slots:
                raise AssertionError(f"workspace slot {name!r} placed twice")
            dtype = np.dtype(dtype)
            offset = _align(offset)
            self.slots[name] = _Slot(offset, tuple(int(d) for d in shape), dtype)
            offset += math.prod(shape) * dtype.itemsize
        return offset

    def add(self, name: str, shape: tuple[int, ...], dtype: Any) -> None:
        self.end = self._place(self.end, [(name, shape, dtype)])

    def overlay(self, *groups: Sequence[tuple[str, tuple[int, ...], Any]]) -> None:
        start = _align(self.end)
        self.end = max([self._place(start, group) for group in groups], default=start)

    @property
    def nbytes(self) -> int:
        return self.end + ALIGN_BYTES if self.end else 0

    def carve(self, workspace: np.ndarray) -> dict[str, np.ndarray]:
        """Views of `workspace` for every slot (no copies, no allocation of array data)."""
        base = (-workspace.ctypes.data) % ALIGN_BYTES
        return {name: np.ndarray(slot.shape, slot.dtype, buffer=workspace, offset=base + slot.offset)
                for name, slot in self.slots.items()}


# ---- shared helpers --------------------------------------------------------------------------

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


def _complex_dtype(dtype: np.dtype) -> np.dtype:
    return np.result_type(dtype, np.complex64)


# ---- im2col + GEMM -------------------------------------------------------------------------
# Columns are laid out (c, r, s, n, oh, ow): the rows of one group are one contiguous
# (c/g * r * s) x (n * P) block, so each group is a single large GEMM against the filter viewed as
# (k/g) x (c/g * r * s), and numpy.matmul over a leading group axis runs all groups in one call.

def _im2col_layout(p: ConvProblem) -> _Layout:
    dt = np.dtype(p.dtype)
    n_p = p.n * p.out_h * p.out_w
    lay = _Layout()
    if p.kind in ("fwd", "bwd_filter"):
        lay.add("col", (p.c, p.r, p.s, p.n, p.out_h, p.out_w), dt)
    if p.kind in ("bwd_data", "bwd_filter"):
        lay.add("dyt", (p.k, p.n, p.out_h * p.out_w), dt)
    if p.kind == "fwd":
        lay.add("yt", (p.k, n_p), dt)
    elif p.kind == "bwd_data":
        lay.add("dcol", (p.c, p.r, p.s, p.n, p.out_h, p.out_w), dt)
    else:
        lay.add("dw", (p.k, (p.c // p.groups) * p.r * p.s), dt)
    return lay


def _im2col_fill(p: ConvProblem, col: np.ndarray, x: np.ndarray) -> None:
    xt = x.transpose(1, 0, 2, 3)  # (c, n, h, w), matching the column layout
    for i in range(p.r):
        for j in range(p.s):
            _gather(col[:, i, j], xt, (p.stride_h, i * p.dilation_h - p.pad_h),
                    (p.stride_w, j * p.dilation_w - p.pad_w))


def _run_im2col(p: ConvProblem, ws: dict[str, np.ndarray], x, w, dy, out, alpha: float, beta: float) -> None:
    g, kg, cg = p.groups, p.k // p.groups, p.c // p.groups
    crs_g = cg * p.r * p.s
    n_p = p.n * p.out_h * p.out_w
    if p.kind in ("bwd_data", "bwd_filter"):
        np.copyto(ws["dyt"], dy.reshape(p.n, p.k, -1).transpose(1, 0, 2))
        dy_g = ws["dyt"].reshape(g, kg, n_p)
    if p.kind in ("fwd", "bwd_filter"):
        _im2col_fill(p, ws["col"], x)
        col_g = ws["col"].reshape(g, crs_g, n_p)
    if p.kind == "fwd":
        np.matmul(w.reshape(g, kg, crs_g), col_g, out=ws["yt"].reshape(g, kg, n_p))
        _blend(out.reshape(p.n, p.k, -1), ws["yt"].reshape(p.k, p.n, -1).transpose(1, 0, 2), alpha, beta)
    elif p.kind == "bwd_filter":
        np.matmul(dy_g, col_g.transpose(0, 2, 1), out=ws["dw"].reshape(g, kg, crs_g))
        _blend(out.reshape(p.k, -1), ws["dw"], alpha, beta)
    else:
        dcol = ws["dcol"]
        np.matmul(w.reshape(g, kg, crs_g).transpose(0, 2, 1), dy_g, out=dcol.reshape(g, crs_g, n_p))
        if alpha != 1.0:
            np.multiply(dcol, alpha, out=dcol)
        _scale_out(out, beta)
        # col2im: no NumPy/SciPy routine folds columns back with stride and dilation, so each
        # filter offset scatter-adds its (c, n, oh, ow) slab into the image.
        outt = out.transpose(1, 0, 2, 3)
        for i in range(p.r):
            for j in range(p.s):
                _scatter_add(outt, dcol[:, i, j], (p.stride_h, i * p.dilation_h - p.pad_h),
                             (p.stride_w, j * p.dilation_w - p.pad_w))


# ---- shifted GEMM --------------------------------------------------------------------------
# One sample at a time; per filter offset (i, j) a GEMM against the (c, oh, ow) slab of the input
# shifted by that offset. BLAS gemm with beta = 1 accumulates in place (numpy.matmul cannot), so
# SciPy's BLAS wrappers are called on Fortran-ordered views (the transposes of our C-ordered
# arrays), which they use without copying.

def _shift_layout(p: ConvProblem) -> _Layout:
    dt = np.dtype(p.dtype)
    lay = _Layout()
    lay.add("wt", (p.r, p.s, p.k, p.c // p.groups), dt)  # filter per offset; dW accumulator for bwd_filter
    lay.add("slab", (p.c, p.out_h, p.out_w), dt)
    return lay


def _gemm(dtype: np.dtype):
    return scipy_blas.sgemm if dtype == np.float32 else scipy_blas.dgemm


def _run_shift(p: ConvProblem, ws: dict[str, np.ndarray], x, w, dy, out, alpha: float, beta: float) -> None:
    g, kg, cg = p.groups, p.k // p.groups, p.c // p.groups
    n_p = p.out_h * p.out_w
    gemm = _gemm(np.dtype(p.dtype))
    wt, slab = ws["wt"], ws["slab"]
    slab_g = slab.reshape(g, cg, n_p)
    offsets = [(i, j, (p.stride_h, i * p.dilation_h - p.pad_h), (p.stride_w, j * p.dilation_w - p.pad_w))
               for i in range(p.r) for j in range(p.s)]
    if p.kind != "bwd_filter":
        np.copyto(wt, w.transpose(2, 3, 0, 1))
    for n in range(p.n):
        if p.kind == "fwd":
            y_g = out[n].reshape(g, kg, n_p)
            for t, (i, j, rows, cols) in enumerate(offsets):
                _gather(slab, x[n], rows, cols)
                for gi in range(g):
                    # y_g^T (P, kg) = slab_g^T (P, cg) @ W_ij_g^T (cg, kg), accumulated
                    gemm(alpha, slab_g[gi].T, wt[i, j, gi * kg:(gi + 1) * kg].T,
                         beta=beta if t == 0 else 1.0, c=y_g[gi].T, overwrite_c=1)
        elif p.kind == "bwd_data":
            dy_g = dy[n].reshape(g, kg, n_p)
            _scale_out(out[n], beta)
            for i, j, rows, cols in offsets:
                for gi in range(g):
                    # slab_g^T (P, cg) = dy_g^T (P, kg) @ W_ij_g (kg, cg)
                    gemm(alpha, dy_g[gi].T, wt[i, j, gi * kg:(gi + 1) * kg].T, trans_b=1,
                         beta=0.0, c=slab_g[gi].T, overwrite_c=1)
                _scatter_add(out[n], slab, rows, cols)
        else:
            dy_g = dy[n].reshape(g, kg, n_p)
            for i, j, rows, cols in offsets:
                _gather(slab, x[n], rows, cols)
                for gi in range(g):
                    # dW_ij_g^T (cg, kg) += slab_g (cg, P) @ dy_g^T (P, kg)
                    gemm(1.0, slab_g[gi].T, dy_g[gi].T, trans_a=1, beta=0.0 if n == 0 else 1.0,
                         c=wt[i, j, gi * kg:(gi + 1) * kg].T, overwrite_c=1)
    if p.kind == "bwd_filter":
        _blend(out, wt.transpose(2, 3, 0, 1), alpha, beta)


# ---- FFT -----------------------------------------------------------------------------------
# Correlation on an lh x lw periodic grid. The input sits at rows/columns 0.., dy at multiples of
# the stride, and filter tap (i, j) at (i * dil_h - pad_h, j * dil_w - pad_w) modulo the grid, so
# padding, stride and dilation are all just placement, and the grid is large enough that nothing
# wraps onto a value that is read:
#   fwd        y[u]  = sum_m x[u + m] f[m]        Y  = X conj(F)   summed over c
#   bwd_data   dx[a] = sum_m dy^[a - m] f[m]      DX = DY^ F       summed over k
#   bwd_filter dw[m] = sum_t dy^[t] x[t + m]      DW = X conj(DY^) summed over n
# (dy^ is dy spread out by the stride). Spectra are stored frequency-major, (lh, lw/2+1, a, b), so
# each grid row is one contiguous block and the channel sums are one complex GEMM per frequency
# (and group) through numpy.matmul.
#
# Images (x, dy, y, dx) go through FFTs. Row transforms (the real axis) use NumPy's FFT, the only
# one that takes `out=`; column transforms run in place along the leading axis of the spectrum
# with scipy.fft (overwrite_x on a complex array transforms in place, vectorised across columns,
# on every core). Both use norm="ortho" (NumPy's default-normalised forward transform multiplies
# by a Python int and so computes in float64 through a hidden temporary), and a conjugated
# spectrum comes from the inverse transforms (conj(FFT(a)) = IFFT(a) for real a under "ortho").
#
# Filters go through DFT matrices instead: a filter has only r x s non-zero taps on the grid, so
# its exact (unnormalised) spectrum is two small-K GEMMs against the DFT rows of those taps, far
# cheaper than FFTs of k * c/g mostly-empty grids, and bwd_filter needs only the r x s taps of its
# inverse, again two GEMMs. With ortho image transforms and exact filter transforms the scales
# cancel: ortho forward (1/sqrt N) times ortho inverse (sqrt N times the 1/N inverse).

FFT_WORKERS = -1  # scipy.fft's workers by default: every core this process may use


def _fft_grid(p: ConvProblem) -> tuple[int, int]:
    full_h = p.h + 2 * p.pad_h - p.dilated_r + 1
    full_w = p.w + 2 * p.pad_w - p.dilated_s + 1
    lh = scipy.fft.next_fast_len(max(p.h + p.pad_h, p.dilated_r, full_h), real=True)
    lw = scipy.fft.next_fast_len(max(p.w + p.pad_w, p.dilated_s, full_w), real=True)
    return lh, lw


def _in_place(result: np.ndarray, spectrum: np.ndarray) -> None:
    if not np.shares_memory(result, spectrum):  # scipy.fft stopped transforming in place
        raise AssertionError("scipy.fft with overwrite_x returned a new array; the workspace would be bypassed")


def _image_spectrum(a: np.ndarray, steps: tuple[int, int], grid: tuple[int, int], real: np.ndarray | None,
                    half: np.ndarray, spectrum: np.ndarray, *, conjugate: bool = False) -> None:
    """spectrum (lh, lw//2+1, A, B) = ortho 2-D FFT (conjugated if asked) of a (A, B, H, W) whose
    sample (p, q) sits at grid point (p * steps[0], q * steps[1]).

    `half` (A, B, H, lw//2+1) holds the row transforms; `real` (A, B, H, lw) the spread-out rows
    when steps[1] > 1.
    """
    lh, lw = grid
    rows = a.shape[-2]
    src = a
    if steps[1] != 1:
        src = real
        src[...] = 0
        np.copyto(src[..., :(a.shape[-1] - 1) * steps[1] + 1:steps[1]], a)
    (np.fft.ihfft if conjugate else np.fft.rfft)(src, n=lw, axis=-1, norm="ortho", out=half)
    placed = np.zeros(lh, bool)
    placed[:(rows - 1) * steps[0] + 1:steps[0]] = True
    for u in np.flatnonzero(~placed):
        spectrum[u] = 0
    np.copyto(spectrum[:(rows - 1) * steps[0] + 1:steps[0]], half.transpose(2, 3, 0, 1))
    column_fft = scipy.fft.ifft if conjugate else scipy.fft.fft
    _in_place(column_fft(spectrum, axis=0, norm="ortho", overwrite_x=True), spectrum)


def _image_inverse(spectrum: np.ndarray, steps: tuple[int, int], grid: tuple[int, int], half: np.ndarray,
                   real: np.ndarray, out: np.ndarray, alpha: float, beta: float) -> None:
    """out (A, B, H, W) = alpha * image[p * steps[0], q * steps[1]] + beta * out, where image is the
    ortho inverse 2-D FFT of spectrum (lh, lw//2+1, A, B), which is overwritten.

    `half` (A, B, H, lw//2+1) and `real` (A, B, H, lw) are scratch.
    """
    lh, lw = grid
    rows, cols = out.shape[-2:]
    _in_place(scipy.fft.ifft(spectrum, axis=0, norm="ortho", overwrite_x=True), spectrum)
    np.copyto(half.transpose(2, 3, 0, 1), spectrum[:(rows - 1) * steps[0] + 1:steps[0]])
    np.fft.irfft(half, n=lw, axis=-1, norm="ortho", out=real)
    _blend(out, real[..., :(cols - 1) * steps[1] + 1:steps[1]], alpha, beta)


def _dft_rows(out: np.ndarray, freqs: int, taps: int, step: int, offset: int, length: int, sign: float,
              phase: np.ndarray, *, taps_first: bool = False, weights: np.ndarray | None = None) -> None:
    """out[f, t] (or out[t, f] with taps_first) = weights[f] * exp(sign 2 pi i f pos_t / length),
    pos_t = offset + t * step; `phase` is float64 scratch of at least freqs * taps elements."""
    shape = (taps, freqs) if taps_first else (freqs, taps)
    angle = phase[:freqs * taps].reshape(shape)
    f = np.arange(freqs, dtype=np.float64)
    pos = np.arange(taps, dtype=np.float64) * step + offset
    np.multiply.outer(pos, f, out=angle) if taps_first else np.multiply.outer(f, pos, out=angle)
    np.remainder(angle, length, out=angle)  # exact: integers far below 2**53
    np.multiply(angle, sign * 2 * math.pi / length, out=angle)
    np.cos(angle, out=out.real)
    np.sin(angle, out=out.imag)
    if weights is not None:
        np.multiply(out, weights if taps_first else weights[:, None], out=out)


def _filter_spectrum(p: ConvProblem, w_t: np.ndarray, grid: tuple[int, int], ws: dict[str, np.ndarray],
                     spectrum: np.ndarray, *, conjugate: bool) -> None:
    """spectrum (lh, lw//2+1, P, Q) = exact DFT (conjugated if asked) of the filter taps on the grid.

    w_t is the filter as (s, r, P, Q); column taps first (K = s), then row taps (K = r).
    """
    lh, lw = grid
    lwr = lw // 2 + 1
    sign = 1.0 if conjugate else -1.0
    eh, ew, z1 = ws["eh"], ws["ew"], ws["z1"]
    wc = ws["wc"].reshape(w_t.shape)  # (s, r, k, c/g) slot, same size in either order
    _dft_rows(eh, lh, p.r, p.dilation_h, -p.pad_h, lh, sign, ws["phase"])
    _dft_rows(ew, lwr, p.s, p.dilation_w, -p.pad_w, lw, sign, ws["phase"])
    np.copyto(wc, w_t)
    rest = math.prod(w_t.shape[1:])
    np.matmul(ew, wc.reshape(p.s, rest), out=z1.reshape(lwr, rest))
    pq = rest // p.r
    np.matmul(eh, z1.reshape(lwr, p.r, pq), out=spectrum.reshape(lh, lwr, pq).transpose(1, 0, 2))


def _filter_inverse(p: ConvProblem, spectrum: np.ndarray, grid: tuple[int, int], ws: dict[str, np.ndarray],
                    out: np.ndarray, alpha: float, beta: float) -> None:
    """out (k, c/g, r, s) = alpha * (real inverse DFT of spectrum (lh, lw//2+1, k, c/g) at the
    filter taps) + beta * out, without the 1/N: the ortho forward transforms carry it."""
    lh, lw = grid
    lwr = lw // 2 + 1
    # A real signal's spectrum keeps columns 0..lw/2: the others are conjugates, so the inverse
    # counts each kept column twice except 0 and (for even lw) lw/2, and keeps the real part.
    weights = np.full(lwr, 2.0)
    weights[0] = 1.0
    if lw % 2 == 0:
        weights[-1] = 1.0
    ehinv, awinv, z, t = ws["ehinv"], ws["awinv"], ws["z"], ws["t"]
    _dft_rows(ehinv, lh, p.r, p.dilation_h, -p.pad_h, lh, 1.0, ws["phase"], taps_first=True)
    _dft_rows(awinv, lwr, p.s, p.dilation_w, -p.pad_w, lw, 1.0, ws["phase"], taps_first=True, weights=weights)
    kc = math.prod(spectrum.shape[2:])
    np.matmul(ehinv, spectrum.reshape(lh, lwr * kc), out=z.reshape(p.r, lwr * kc))
    np.matmul(awinv, z.reshape(p.r, lwr, kc), out=t.reshape(p.r, p.s, kc))
    _blend(out, t.real.transpose(2, 3, 0, 1), alpha, beta)


def _fft_layout(p: ConvProblem) -> _Layout:
    dt = np.dtype(p.dtype)
    cdt = _complex_dtype(dt)
    lh, lw = _fft_grid(p)
    lwr = lw // 2 + 1
    freq = (lh, lwr)
    cg = p.c // p.groups
    lay = _Layout()

    def image_scratch(prefix, lead, rows, col_step):
        spread = [(prefix + "_real", (*lead, rows, lw), dt)] if col_step != 1 else []
        return [*spread, (prefix + "_half", (*lead, rows, lwr), cdt)]

    def output_scratch(lead, rows):
        return [("out_half", (*lead, rows, lwr), cdt), ("out_real", (*lead, rows, lw), dt)]

    lay.add("phase", (max(lh, lwr) * max(p.r, p.s),), np.float64)
    if p.kind == "bwd_filter":
        lay.add("ehinv", (p.r, lh), cdt)
        lay.add("awinv", (p.s, lwr), cdt)
        lay.add("xf", (*freq, p.n, p.c), cdt)
        lay.add("dyf", (*freq, p.n, p.k), cdt)
        lay.add("dwf", (*freq, p.k, cg), cdt)
        lay.overlay(image_scratch("x", (p.n, p.c), p.h, 1), image_scratch("dy", (p.n, p.k), p.out_h, p.stride_w),
                    [("z", (p.r, lwr, p.k, cg), cdt), ("t", (p.r, p.s, p.k, cg), cdt)])
        return lay
    lay.add("eh", (lh, p.r), cdt)
    lay.add("ew", (lwr, p.s), cdt)
    filter_scratch = [("wc", (p.s, p.r, p.k, cg), cdt), ("z1", (lwr, p.r, p.k, cg), cdt)]
    if p.kind == "fwd":
        lay.add("kf", (*freq, cg, p.k), cdt)
        lay.add("xf", (*freq, p.n, p.c), cdt)
        lay.add("yf", (*freq, p.n, p.k), cdt)
        lay.overlay(filter_scratch, image_scratch("x", (p.n, p.c), p.h, 1), output_scratch((p.n, p.k), p.out_h))
    else:
        lay.add("kf", (*freq, p.k, cg), cdt)
        lay.add("dyf", (*freq, p.n, p.k), cdt)
        lay.add("dxf", (*freq, p.n, p.c), cdt)
        lay.overlay(filter_scratch, image_scratch("dy", (p.n, p.k), p.out_h, p.stride_w),
                    output_scratch((p.n, p.c), p.h))
    return lay


def _run_fft(p: ConvProblem, ws: dict[str, np.ndarray], x, w, dy, out, alpha: float, beta: float) -> None:
    grid = lh, lw = _fft_grid(p)
    nf = lh * (lw // 2 + 1)
    g, kg, cg = p.groups, p.k // p.groups, p.c // p.groups
    strides = (p.stride_h, p.stride_w)

    def by_group(name: str, rows: int, cols: int) -> np.ndarray:  # (nf, g, rows, cols/g) matrices
        return ws[name].reshape(nf, rows, g, cols // g).transpose(0, 2, 1, 3)

    if p.kind == "fwd":
        _filter_spectrum(p, w.transpose(3, 2, 1, 0), grid, ws, ws["kf"], conjugate=True)  # kf: (.., cg, k)
        _image_spectrum(x, (1, 1), grid, None, ws["x_half"], ws["xf"])
        np.matmul(by_group("xf", p.n, p.c), by_group("kf", cg, p.k), out=by_group("yf", p.n, p.k))
        _image_inverse(ws["yf"], strides, grid, ws["out_half"], ws["out_real"], out, alpha, beta)
    elif p.kind == "bwd_data":
        _filter_spectrum(p, w.transpose(3, 2, 0, 1), grid, ws, ws["kf"], conjugate=False)
        _image_spectrum(dy, strides, grid, ws.get("dy_real"), ws["dy_half"], ws["dyf"])
        np.matmul(by_group("dyf", p.n, p.k), ws["kf"].reshape(nf, g, kg, cg), out=by_group("dxf", p.n, p.c))
        _image_inverse(ws["dxf"], (1, 1), grid, ws["out_half"], ws["out_real"], out, alpha, beta)
    else:
        _image_spectrum(x, (1, 1), grid, None, ws["x_half"], ws["xf"])
        _image_spectrum(dy, strides, grid, ws.get("dy_real"), ws["dy_half"], ws["dyf"], conjugate=True)
        dyf_t = by_group("dyf", p.n, p.k).transpose(0, 1, 3, 2)  # (nf, g, kg, n)
        np.matmul(dyf_t, by_group("xf", p.n, p.c), out=ws["dwf"].reshape(nf, g, kg, cg))
        _filter_inverse(p, ws["dwf"], grid, ws, out, alpha, beta)


# ---- Winograd F(2x2, 3x3) --------------------------------------------------------------------
# Y = A^T [(G g G^T) . (B^T d B)] A on 4x4 input tiles that overlap by 2, with the 16 products
# summed over channels as 16 GEMMs (one numpy.matmul over the 16 points and the groups). NumPy has
# no Winograd. The image transforms read overlapping strided views of the tiles, so they are
# written out as additions of views with `out=`:
#   B^T d  : d0 - d2, d1 + d2, d2 - d1, d1 - d3
#   A^T m  : m0 + m1 + m2, m1 - m2 - m3
# Filters do not overlap, so their transform is one GEMM with kron(G, G) (16 x 9).
# bwd_data is the same correlation of dy with the flipped, transposed filter: the flip reverses
# the 9 taps (columns of kron(G, G)) and the transpose is the GEMM's transposed operand. bwd_filter
# is F(3x3, 2x2), the transpose of the same algorithm: dW = G^T [(A e A^T) . (B^T d B)] G summed over
# tiles and samples, with A e : e0, e0 + e1, e0 - e1, -e1, and G^T . G one GEMM with kron(G, G)^T.

_WINO_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])


@functools.cache
def _wino_filter_matrix(dtype: str, flipped: bool) -> np.ndarray:
    """kron(G, G) (16 x 9), its taps reversed when `flipped`; read-only."""
    matrix = np.kron(_WINO_G, _WINO_G)
    matrix = np.ascontiguousarray(matrix[:, ::-1] if flipped else matrix, dtype=dtype)
    matrix.flags.writeable = False
    return matrix


def _wino_tiles(out_h: int, out_w: int) -> tuple[int, int]:
    return -(-out_h // 2), -(-out_w // 2)


# Tiles are stored channels-last, (rows, cols, n, channels), so every transform step is an
# addition of views whose innermost axis is a long contiguous run of n * channels values, and each
# Winograd point is a (tiles * n) x channels matrix that BLAS reads as-is or transposed.

def _wino_input_transform(inp: np.ndarray, offsets: tuple[int, int], d: np.ndarray, t: np.ndarray,
                          v: np.ndarray) -> None:
    """v[a, b] (th, tw, n, cin) = B^T d B of the 4x4 tiles of inp (n, cin, H, W) read from `offsets`."""
    th, tw = v.shape[2:4]
    _gather(d.transpose(2, 3, 0, 1), inp, (1, offsets[0]), (1, offsets[1]))
    rows = [d[q:q + 2 * th:2] for q in range(4)]
    np.subtract(rows[0], rows[2], out=t[0])
    np.add(rows[1], rows[2], out=t[1])
    np.subtract(rows[2], rows[1], out=t[2])
    np.subtract(rows[1], rows[3], out=t[3])
    for a in range(4):
        cols = [t[a][:, q:q + 2 * tw:2] for q in range(4)]
        np.subtract(cols[0], cols[2], out=v[a, 0])
        np.add(cols[1], cols[2], out=v[a, 1])
        np.subtract(cols[2], cols[1], out=v[a, 2])
        np.subtract(cols[1], cols[3], out=v[a, 3])


def _wino_output_transform(m: np.ndarray, s: np.ndarray, yq: np.ndarray, out: np.ndarray,
                           alpha: float, beta: float) -> None:
    """out[:, :, 2ti + a, 2tj + b] = alpha * (A^T m A)[a, b] + beta * out, m (4, 4, th, tw, n, cout)."""
    np.add(m[0], m[1], out=s[0])
    np.add(s[0], m[2], out=s[0])
    np.subtract(m[1], m[2], out=s[1])
    np.subtract(s[1], m[3], out=s[1])
    oh, ow = out.shape[-2:]
    for a in range(2):
        rows = (oh - a + 1) // 2
        for b in range(2):
            cols = (ow - b + 1) // 2
            if b == 0:
                np.add(s[a, 0], s[a, 1], out=yq)
                np.add(yq, s[a, 2], out=yq)
            else:
                np.subtract(s[a, 1], s[a, 2], out=yq)
                np.subtract(yq, s[a, 3], out=yq)
            _blend(out[:, :, a::2, b::2], yq[:rows, :cols].transpose(2, 3, 0, 1), alpha, beta)


def _winograd_reason(p: ConvProblem) -> str | None:
    if (p.r, p.s) != (3, 3):
        return f"winograd F(2x2,3x3) needs a 3x3 filter, got {p.r}x{p.s}"
    if (p.stride_h, p.stride_w) != (1, 1):
        return f"winograd F(2x2,3x3) needs stride 1, got {p.stride_h}x{p.stride_w}"
    if (p.dilation_h, p.dilation_w) != (1, 1):
        return f"winograd F(2x2,3x3) needs dilation 1, got {p.dilation_h}x{p.dilation_w}"
    return None


def _winograd_layout(p: ConvProblem) -> _Layout:
    dt = np.dtype(p.dtype)
    cg = p.c // p.groups
    lay = _Layout()
    if p.kind == "bwd_filter":
        th, tw = _wino_tiles(p.out_h, p.out_w)
        lay.add("v", (4, 4, th, tw, p.n, p.c), dt)
        lay.add("e", (4, 4, th, tw, p.n, p.k), dt)
        lay.add("m", (4, 4, p.k, cg), dt)
        lay.overlay([("d", (2 * th + 2, 2 * tw + 2, p.n, p.c), dt), ("t", (4, th, 2 * tw + 2, p.n, p.c), dt)],
                    [("dyp", (2 * th, 2 * tw, p.n, p.k), dt), ("ty", (4, th, 2 * tw, p.n, p.k), dt)],
                    [("dw", (3, 3, p.k, cg), dt)])
        return lay
    if p.kind == "fwd":
        cin, cout, oh, ow = p.c, p.k, p.out_h, p.out_w
    else:
        cin, cout, oh, ow = p.k, p.c, p.h, p.w
    th, tw = _wino_tiles(oh, ow)
    lay.add("u", (4, 4, p.k, cg), dt)  # G g G^T for every (k, c/g) filter, as stored
    lay.add("v", (4, 4, th, tw, p.n, cin), dt)
    lay.add("m", (4, 4, th, tw, p.n, cout), dt)
    lay.overlay([("d", (2 * th + 2, 2 * tw + 2, p.n, cin), dt), ("t", (4, th, 2 * tw + 2, p.n, cin), dt)],
                [("s", (2, 4, th, tw, p.n, cout), dt), ("yq", (th, tw, p.n, cout), dt)])
    return lay


def _run_winograd(p: ConvProblem, ws: dict[str, np.ndarray], x, w, dy, out, alpha: float, beta: float) -> None:
    g, kg, cg = p.groups, p.k // p.groups, p.c // p.groups
    if p.kind == "bwd_filter":
        th, tw = _wino_tiles(p.out_h, p.out_w)
        nt = p.n * th * tw
        v, e, m = ws["v"], ws["e"], ws["m"]
        _wino_input_transform(x, (-p.pad_h, -p.pad_w), ws["d"], ws["t"], v)
        dyp, ty = ws["dyp"], ws["ty"]
        _gather(dyp.transpose(2, 3, 0, 1), dy, (1, 0), (1, 0))  # zero row/column completes odd tiles
        r0, r1 = dyp[0::2], dyp[1::2]
        np.copyto(ty[0], r0)
        np.add(r0, r1, out=ty[1])
        np.subtract(r0, r1, out=ty[2])
        np.negative(r1, out=ty[3])
        for a in range(4):
            c0, c1 = ty[a][:, 0::2], ty[a][:, 1::2]
            np.copyto(e[a, 0], c0)
            np.add(c0, c1, out=e[a, 1])
            np.subtract(c0, c1, out=e[a, 2])
            np.negative(c1, out=e[a, 3])
        # M[point] (kg, cg) = E[point]^T (kg, tiles * n) @ V[point] (tiles * n, cg), per group
        np.matmul(e.reshape(16, nt, g, kg).transpose(0, 2, 3, 1), v.reshape(16, nt, g, cg).transpose(0, 2, 1, 3),
                  out=m.reshape(16, g, kg, cg))
        dw = ws["dw"]
        np.matmul(_wino_filter_matrix(p.dtype, False).T, m.reshape(16, p.k * cg), out=dw.reshape(9, p.k * cg))
        _blend(out, dw.transpose(2, 3, 0, 1), alpha, beta)
        return
    u = ws["u"]
    np.matmul(_wino_filter_matrix(p.dtype, p.kind == "bwd_data"), w.reshape(p.k * cg, 9).T,
              out=u.reshape(16, p.k * cg))
    u_g = u.reshape(16, g, kg, cg)  # fwd: (cout_g, cin_g) per point and group
    if p.kind == "fwd":
        inp, offsets, cin_g, cout_g = x, (-p.pad_h, -p.pad_w), cg, kg
    else:
        inp, offsets, cin_g, cout_g = dy, (p.pad_h - 2, p.pad_w - 2), kg, cg
        u_g = u_g.transpose(0, 1, 3, 2)  # the transposed filter: (c/g, k/g)
    th, tw = _wino_tiles(*out.shape[-2:])
    nt = p.n * th * tw
    _wino_input_transform(inp, offsets, ws["d"], ws["t"], ws["v"])
    # M[point] (tiles * n, cout_g) = V[point] (tiles * n, cin_g) @ U[point]^T (cin_g, cout_g), per group
    np.matmul(ws["v"].reshape(16, nt, g, cin_g).transpose(0, 2, 1, 3), u_g.transpose(0, 1, 3, 2),
              out=ws["m"].reshape(16, nt, g, cout_g).transpose(0, 2, 1, 3))
    _wino_output_transform(ws["m"], ws["s"], ws["yq"], out, alpha, beta)


# ---- native (PyTorch) ------------------------------------------------------------------------

@functools.cache
def _torch_version() -> str | None:
    """PyTorch's version when it is installed, found without importing it (that takes seconds,
    which a run served entirely from the cache should not pay)."""
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _native_launcher(p: ConvProblem):
    """`native` as a launcher, its torch call fixed once: aten's convolution and
    convolution_backward directly (torch.nn.grad's wrappers re-derive their arguments per call),
    and the result copied into `out` by torch when no scaling is asked for. Operands from NumPy
    need no gradient, so no autograd graph is built."""
    import torch

    stride, padding, dilation = [p.stride_h, p.stride_w], [p.pad_h, p.pad_w], [p.dilation_h, p.dilation_w]
    mask = [p.kind == "bwd_data", p.kind == "bwd_filter", False]
    backward = torch.ops.aten.convolution_backward
    x_shape, w_shape = list(p.x_shape), list(p.w_shape)

    def launch(x, w, dy, out, workspace, alpha, beta):
        if p.kind == "fwd":
            result = torch.conv2d(torch.from_numpy(x), torch.from_numpy(w), None, stride, padding, dilation, p.groups)
        elif p.kind == "bwd_data":
            tdy = torch.from_numpy(dy)
            result = backward(tdy, _shaped(tdy, x_shape), torch.from_numpy(w), None, stride, padding, dilation, False,
                              [0, 0], p.groups, mask)[0]
        else:
            tdy = torch.from_numpy(dy)
            result = backward(tdy, torch.from_numpy(x), _shaped(tdy, w_shape), None, stride, padding, dilation, False,
                              [0, 0], p.groups, mask)[1]
        if alpha == 1.0 and beta == 0.0:
            torch.from_numpy(out).copy_(result)
        else:
            _blend(out, result.contiguous().numpy(), alpha, beta)

    return launch


def _shaped(like, shape):
    """A tensor of `shape` holding one element (a stride-0 view), as torch.nn.grad passes the operand
    whose gradient is not asked for: convolution_backward reads only its shape."""
    return like.new_empty(1).expand(shape)


# ---- the backend -----------------------------------------------------------------------------

_LAYOUTS = {IM2COL_GEMM: _im2col_layout, SHIFT_GEMM: _shift_layout, FFT: _fft_layout, WINOGRAD: _winograd_layout}
_RUNS = {IM2COL_GEMM: _run_im2col, SHIFT_GEMM: _run_shift, FFT: _run_fft, WINOGRAD: _run_winograd}


def _blas_version(config: dict) -> str:
    blas = config.get("Build Dependencies", {}).get("blas", {})
    return f"{blas.get('name', 'unknown')} {blas.get('version', 'unknown')}"


_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# Part of every measurement's key: raised when the way of measuring changes what a timing means, so
# that older timings are not reused. 2: the verification reference runs on one BLAS thread (before,
# its pool still spun while the next candidate was timed).
MEASUREMENT_PROTOCOL = 2


@functools.cache
def _device_info() -> DeviceInfo:
    model = platform.processor() or platform.machine() or "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.partition(":")[2].strip()
                    break
    except OSError:  # not Linux: keep the platform module's name for the processor
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # sysconf lacks these names on this platform
        memory_bytes = 0
    versions = {"numpy": np.__version__, "scipy": scipy.__version__,
                "numpy-blas": _blas_version(np.show_config(mode="dicts")),
                "scipy-blas": _blas_version(scipy.show_config(mode="dicts"))}
    if _torch_version() is not None:
        versions["torch"] = _torch_version()
    # Thread counts change every timing, so measurements taken under other settings are not reused.
    for var in _THREAD_VARIABLES:
        versions[var] = os.environ.get(var, "default")
    return DeviceInfo(model=f"{model} ({cores} cores)", memory_bytes=int(memory_bytes),
                      versions=tuple(sorted(versions.items())))


@functools.cache
def _blas_pools():
    """BLAS thread pools loaded in this process, found once (a search of the loaded libraries)."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas")


def _numpy_threads(threads: int | None):
    """The context a NumPy algorithm runs in: BLAS and scipy.fft on `threads` threads (None: BLAS
    as configured, FFTs on every core)."""
    if threads is None:
        return scipy.fft.set_workers(FFT_WORKERS)
    stack = contextlib.ExitStack()
    stack.enter_context(_blas_pools().limit(limits=threads))
    stack.enter_context(scipy.fft.set_workers(threads))
    return stack


class CpuBackend(Backend):
    """Convolution on the CPU over NumPy/SciPy (and PyTorch as `native` when it imports).

    `numpy_threads`: threads for the NumPy algorithms' BLAS calls and FFTs (None: the libraries'
    defaults); see the module docstring."""

    name = "cpu"
    numpy_threads: int | None = None

    def __init__(self, numpy_threads: int | None = None) -> None:
        if numpy_threads is not None and (isinstance(numpy_threads, bool) or not isinstance(numpy_threads, int)
                                          or numpy_threads < 1):
            raise InvalidInput(f"numpy_threads must be a positive integer or None, got {numpy_threads!r}")
        self.numpy_threads = numpy_threads

    def __repr__(self) -> str:
        return f"CpuBackend(numpy_threads={self.numpy_threads})"

    def settings(self) -> dict[str, str]:
        return {} if self.numpy_threads is None else {"numpy_threads": str(self.numpy_threads)}

    def trusted_result(self, problem: ConvProblem, inputs: dict[str, Any]) -> Any:
        # The float64 reference is BLAS work too, and a BLAS pool spins for a while after it: the
        # candidate timed next (torch's own, on its own pool) measured 2x slow. One thread leaves none.
        with _numpy_threads(1):
            return super().trusted_result(problem, inputs)

    @property
    def device(self) -> DeviceInfo:
        return _device_info()

    def algorithms(self, problem: ConvProblem) -> list[str]:
        return list(ALGORITHMS) + ([NATIVE] if _torch_version() is not None else [])

    def versions_for(self, algo: str) -> str:
        # native is PyTorch's convolution; the others are NumPy/SciPy over their BLAS. Both read
        # the thread-count variables. So installing torch keeps every NumPy measurement.
        own = ("torch",) if algo == NATIVE else ("numpy", "numpy-blas", "scipy", "scipy-blas")
        key = ",".join(f"{lib}={ver}" for lib, ver in self.device.versions if lib in own or lib in _THREAD_VARIABLES)
        key += f",protocol={MEASUREMENT_PROTOCOL}"
        if algo != NATIVE and self.numpy_threads is not None:  # default keys stay as they were
            key += f",numpy-threads={self.numpy_threads}"
        return key

    def unsupported_reason(self, problem: ConvProblem, algo: str) -> str | None:
        known = ALGORITHMS + (NATIVE,)
        if algo not in known:
            return f"unknown algorithm {algo!r} for the cpu backend; known: {', '.join(known)}"
        if problem.dtype not in SUPPORTED_DTYPES:
            return f"the cpu backend computes in float32 or float64, not {problem.dtype}"
        if problem.effective_compute_type != problem.dtype:
            return (f"the cpu backend computes in the data type; compute_type {problem.compute_type} "
                    f"differs from dtype {problem.dtype}")
        if problem.layout != "NCHW":
            return f"the cpu backend runs NCHW tensors only, not {problem.layout}"
        if algo == WINOGRAD:
            return _winograd_reason(problem)
        if algo == NATIVE and _torch_version() is None:
            return "native needs PyTorch, which is not installed here"
        return None

    def workspace_size(self, problem: ConvProblem, algo: str) -> int:
        reason = self.unsupported_reason(problem, algo)
        if reason is not None:
            raise UnsupportedProblem(reason)
        if algo == NATIVE:
            # torch allocates its own temporaries and cannot use our buffer, so this is an estimate
            # of what it takes, not a carved size: the result tensor it returns plus the unfolded
            # columns of its reference CPU path for the whole batch. Declaring 0 would make native
            # look free under every limit and hide the memory it really uses.
            itemsize = np.dtype(problem.dtype).itemsize
            columns = problem.n * problem.c * problem.r * problem.s * problem.out_h * problem.out_w
            return (math.prod(problem.out_shape) + columns) * itemsize
        return _LAYOUTS[algo](problem).nbytes

    def empty_workspace(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def random_operands(self, problem: ConvProblem, seed: int = 0) -> dict[str, np.ndarray]:
        # Unsupported dtypes (float16, bfloat16) still get float32 operands, so that `measure` can
        # report every algorithm as unsupported instead of failing here.
        dtype = np.dtype(problem.dtype if problem.dtype in SUPPORTED_DTYPES else "float32")
        rng = np.random.default_rng(seed)
        shapes = {"fwd": ("x", "w"), "bwd_data": ("dy", "w"), "bwd_filter": ("x", "dy")}[problem.kind]
        full = {"x": problem.x_shape, "w": problem.w_shape, "dy": problem.y_shape}
        operands = {name: rng.standard_normal(full[name], dtype=dtype) for name in shapes}
        operands["out"] = np.zeros(problem.out_shape, dtype)
        return operands

    def time_run_ms(self, problem: ConvProblem, algo: str, operands: dict[str, Any], workspace: Any,
                    reps: int, beta: float = 0.0) -> list[float]:
        # The launcher a Handle runs in steady state, after `measure`'s checked warm-up run: the
        # per-call checks and layout work of `run` would otherwise count against every algorithm.
        # It honours beta itself (BLAS beta, or one blend into out), so what is timed is what runs.
        launch = self.prepare_run(problem, algo)
        x, w, dy, out = (operands.get(name) for name in ("x", "w", "dy", "out"))
        return wall_clock_samples_ms(lambda: launch(x, w, dy, out, workspace, 1.0, beta), reps)

    def prepare_run(self, problem: ConvProblem, algo: str):
        """`run` without its per-call work: the workspace layout is computed once and no operand is
        checked (the caller's first, checked `run` vouched for their kind)."""
        reason = self.unsupported_reason(problem, algo)
        if reason is not None:
            raise UnsupportedProblem(reason)
        if algo == NATIVE:
            return _native_launcher(problem)
        carve, compute, threads = _LAYOUTS[algo](problem).carve, _RUNS[algo], self.numpy_threads

        def launch(x, w, dy, out, workspace, alpha, beta):
            with _numpy_threads(threads):
                compute(problem, carve(workspace), x, w, dy, out, alpha, beta)
        return launch

    def run(self, problem: ConvProblem, algo: str, *, x: Any = None, w: Any = None, dy: Any = None,
            out: Any, workspace: Any, alpha: float = 1.0, beta: float = 0.0) -> None:
        reason = self.unsupported_reason(problem, algo)
        if reason is not None:
            raise UnsupportedProblem(reason)
        dtype = np.dtype(problem.dtype)
        needed = {"fwd": {"x": x, "w": w}, "bwd_data": {"dy": dy, "w": w},
                  "bwd_filter": {"x": x, "dy": dy}}[problem.kind]
        shapes = {"x": problem.x_shape, "w": problem.w_shape, "dy": problem.y_shape}
        for name, array in [*needed.items(), ("out", out)]:
            shape = problem.out_shape if name == "out" else shapes[name]
            if array is None:
                raise InvalidInput(f"{problem.kind} needs operand {name!r}, got None")
            if not isinstance(array, np.ndarray):
                raise InvalidInput(f"operand {name!r} must be a NumPy array, got {type(array).__name__}")
            if array.shape != shape or array.dtype != dtype:
                raise InvalidInput(f"operand {name!r} must be {dtype} with shape {shape}, "
                                   f"got {array.dtype} with shape {array.shape}")
            if not array.flags.c_contiguous:
                raise InvalidInput(f"operand {name!r} must be C-contiguous (NCHW)")
        if not out.flags.writeable:
            raise InvalidInput("operand 'out' must be writeable")
        alpha, beta = float(alpha), float(beta)
        if algo == NATIVE:
            _native_launcher(problem)(x, w, dy, out, workspace, alpha, beta)
            return
        layout = _LAYOUTS[algo](problem)
        if not (isinstance(workspace, np.ndarray) and workspace.dtype == np.uint8 and workspace.ndim == 1):
            raise InvalidInput("workspace must be a 1-D NumPy uint8 array (see empty_workspace)")
        if workspace.nbytes < layout.nbytes:
            raise InvalidInput(f"workspace has {workspace.nbytes} bytes; {algo} on {problem.spec} "
                               f"({problem.kind}) needs {layout.nbytes}")
        if layout.nbytes and not workspace.flags.c_contiguous:
            raise InvalidInput("workspace must be contiguous")
        with _numpy_threads(self.numpy_threads):
            _RUNS[algo](problem, layout.carve(workspace), x, w, dy, out, alpha, beta)
