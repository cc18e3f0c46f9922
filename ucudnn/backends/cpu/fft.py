"""`fft`: real FFTs of the images, exact DFTs of the filter taps, a complex GEMM per frequency that
sums over channels, inverse FFTs. Padding, stride and dilation are where samples are placed on the
FFT grid, so every problem is supported. Its workspace layout is beside it; it grows linearly with n."""

from __future__ import annotations

import math

import numpy as np
import scipy.fft

from ucudnn.backends.cpu.common import _blend
from ucudnn.backends.cpu.layout import _Layout
from ucudnn.problem import ConvProblem


def _complex_dtype(dtype: np.dtype) -> np.dtype:
    return np.result_type(dtype, np.complex64)


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
