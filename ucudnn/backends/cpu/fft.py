"""`fft`: real FFTs of the images, exact DFTs of the filter taps, a complex GEMM per frequency that
sums over channels, inverse FFTs, over 2 or 3 spatial axes. Padding, stride and dilation are where
samples are placed on the FFT grid, so every problem is supported. Its workspace layout is beside
it; it grows linearly with n."""

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
# Correlation on a periodic grid (lh x lw in 2-D, ld x lh x lw in 3-D). The input sits at grid
# points 0.., dy at multiples of the stride, and filter tap (i, j) at (i * dil_h - pad_h,
# j * dil_w - pad_w) modulo the grid, so padding, stride and dilation are all just placement, and
# the grid is large enough that nothing wraps onto a value that is read:
#   fwd        y[u]  = sum_m x[u + m] f[m]        Y  = X conj(F)   summed over c
#   bwd_data   dx[a] = sum_m dy^[a - m] f[m]      DX = DY^ F       summed over k
#   bwd_filter dw[m] = sum_t dy^[t] x[t + m]      DW = X conj(DY^) summed over n
# (dy^ is dy spread out by the stride). Spectra are stored frequency-major, (lh, lw/2+1, a, b), so
# each grid row is one contiguous block and the channel sums are one complex GEMM per frequency
# (and group) through numpy.matmul.
#
# Images (x, dy, y, dx) go through FFTs. The last axis' transforms (the real axis) use NumPy's FFT,
# the only one that takes `out=`; the leading axes' transforms run in place on the spectrum with
# scipy.fft (overwrite_x on a complex array transforms in place, vectorised, on every core). Both
# use norm="ortho" (NumPy's default-normalised forward transform multiplies by a Python int and so
# computes in float64 through a hidden temporary), and a conjugated spectrum comes from the
# inverse transforms (conj(FFT(a)) = IFFT(a) for real a under "ortho").
#
# Filters go through DFT matrices instead: a filter has only r x s (x t) non-zero taps on the
# grid, so its exact (unnormalised) spectrum is one small-K GEMM per axis against the DFT rows of
# those taps, far cheaper than FFTs of k * c/g mostly-empty grids, and bwd_filter needs only the
# taps of its inverse, again one GEMM per axis. With ortho image transforms and exact filter
# transforms the scales cancel: ortho forward (1/sqrt N) times ortho inverse (sqrt N times the 1/N
# inverse).

FFT_WORKERS = -1  # scipy.fft's workers by default: every core this process may use


def _fft_grid(p: ConvProblem) -> tuple[int, ...]:
    """The periodic grid's extent per spatial axis: nothing read wraps onto a value."""
    return tuple(
        scipy.fft.next_fast_len(max(a.size + a.pad, a.dilated, a.size + 2 * a.pad - a.dilated + 1), real=True)
        for a in p.axes
    )


def _frequencies(grid: tuple[int, ...]) -> tuple[int, ...]:
    """A real signal's spectrum on the grid: every frequency of the leading axes, half of the last."""
    return (*grid[:-1], grid[-1] // 2 + 1)


def _in_place(result: np.ndarray, spectrum: np.ndarray) -> None:
    if not np.shares_memory(result, spectrum):  # scipy.fft stopped transforming in place
        raise AssertionError("scipy.fft with overwrite_x returned a new array; the workspace would be bypassed")


def _to_spectrum_order(lead: int) -> tuple[int, ...]:
    """The transpose of (A, B, rows..., freq) into the spectrum's (rows..., freq, A, B)."""
    return (*range(2, 3 + lead), 0, 1)


def _placed(rows: tuple[int, ...], steps: tuple[int, ...]) -> tuple[slice, ...]:
    """The grid points of the leading axes where an image's samples sit."""
    return tuple(slice(None, (size - 1) * step + 1, step) for size, step in zip(rows, steps))


def _image_spectrum(
    a: np.ndarray,
    steps: tuple[int, ...],
    grid: tuple[int, ...],
    real: np.ndarray | None,
    half: np.ndarray,
    spectrum: np.ndarray,
    *,
    conjugate: bool = False,
) -> None:
    """spectrum (freqs..., A, B) = ortho FFT over every spatial axis (conjugated if asked) of
    a (A, B, sizes...) whose sample (p, q) sits at grid point (p * steps[0], q * steps[1]) (and so on
    per axis).

    `half` (A, B, rows..., lw//2+1) holds the last axis' transforms; `real` (A, B, rows..., lw) the
    spread-out last axis when its step is over 1.
    """
    lead, lw = len(grid) - 1, grid[-1]
    rows = a.shape[2:-1]
    src = a
    if steps[-1] != 1:
        assert real is not None, "a last step over 1 spreads the samples out in `real`"
        src = real
        src[...] = 0
        np.copyto(src[..., : (a.shape[-1] - 1) * steps[-1] + 1 : steps[-1]], a)
    (np.fft.ihfft if conjugate else np.fft.rfft)(src, n=lw, axis=-1, norm="ortho", out=half)
    placed = _placed(rows, steps[:-1])
    for i in range(lead):  # zero the grid points no sample sits on, axis by axis
        mask = np.ones(grid[i], bool)
        mask[placed[i]] = False
        if mask.any():
            unplaced: tuple[slice | np.ndarray, ...] = (*placed[:i], np.flatnonzero(mask))
            spectrum[unplaced] = 0
    np.copyto(spectrum[placed], half.transpose(_to_spectrum_order(lead)))
    column_fft = scipy.fft.ifftn if conjugate else scipy.fft.fftn
    _in_place(column_fft(spectrum, axes=tuple(range(lead)), norm="ortho", overwrite_x=True), spectrum)


def _image_inverse(
    spectrum: np.ndarray,
    steps: tuple[int, ...],
    grid: tuple[int, ...],
    half: np.ndarray,
    real: np.ndarray,
    out: np.ndarray,
    alpha: float,
    beta: float,
) -> None:
    """out (A, B, sizes...) = alpha * image[p * steps[0], q * steps[1], ...] + beta * out, where image
    is the ortho inverse FFT of spectrum (freqs..., A, B), which is overwritten.

    `half` (A, B, rows..., lw//2+1) and `real` (A, B, rows..., lw) are scratch.
    """
    lead, lw = len(grid) - 1, grid[-1]
    _in_place(scipy.fft.ifftn(spectrum, axes=tuple(range(lead)), norm="ortho", overwrite_x=True), spectrum)
    np.copyto(half.transpose(_to_spectrum_order(lead)), spectrum[_placed(out.shape[2:-1], steps[:-1])])
    np.fft.irfft(half, n=lw, axis=-1, norm="ortho", out=real)
    _blend(out, real[..., : (out.shape[-1] - 1) * steps[-1] + 1 : steps[-1]], alpha, beta)


def _dft_rows(
    out: np.ndarray,
    freqs: int,
    taps: int,
    step: int,
    offset: int,
    length: int,
    sign: float,
    phase: np.ndarray,
    *,
    taps_first: bool = False,
    weights: np.ndarray | None = None,
) -> None:
    """out[f, t] (or out[t, f] with taps_first) = weights[f] * exp(sign 2 pi i f pos_t / length),
    pos_t = offset + t * step; `phase` is float64 scratch of at least freqs * taps elements."""
    shape = (taps, freqs) if taps_first else (freqs, taps)
    angle = phase[: freqs * taps].reshape(shape)
    f = np.arange(freqs, dtype=np.float64)
    pos = np.arange(taps, dtype=np.float64) * step + offset
    np.multiply.outer(pos, f, out=angle) if taps_first else np.multiply.outer(f, pos, out=angle)
    np.remainder(angle, length, out=angle)  # exact: integers far below 2**53
    np.multiply(angle, sign * 2 * math.pi / length, out=angle)
    np.cos(angle, out=out.real)
    np.sin(angle, out=out.imag)
    if weights is not None:
        np.multiply(out, weights if taps_first else weights[:, None], out=out)


def _filter_spectrum(
    p: ConvProblem,
    w_t: np.ndarray,
    grid: tuple[int, ...],
    ws: dict[str, np.ndarray],
    spectrum: np.ndarray,
    *,
    conjugate: bool,
) -> None:
    """spectrum (freqs..., P, Q) = exact DFT (conjugated if asked) of the filter taps on the grid.

    w_t is the filter as (taps reversed..., P, Q): (s, r, P, Q) in 2-D. The last axis' taps are
    transformed first (K = s), then each axis before it: one small-K GEMM per axis, the last one
    writing the spectrum.
    """
    axes, freqs = p.axes, _frequencies(grid)
    sign = 1.0 if conjugate else -1.0
    wc = ws["wc"].reshape(w_t.shape)  # a (taps..., k, c/g) slot, the same size in either order
    np.copyto(wc, w_t)
    pq = math.prod(w_t.shape[len(axes) :])
    src: np.ndarray = wc
    done: tuple[int, ...] = ()
    for i in reversed(range(len(axes))):  # src: (freqs of the axes done..., taps of axis i, the rest)
        a, e = axes[i], ws[f"e{i}"]
        _dft_rows(e, freqs[i], a.filter, a.dilation, -a.pad, grid[i], sign, ws["phase"])
        rest = math.prod(axes[j].filter for j in range(i)) * pq
        if i:
            dst = ws[f"z{i}"].reshape(*done, freqs[i], rest)
        else:  # the spectrum, its frequency axes in the order the GEMMs made them
            dst = spectrum.reshape(*freqs, pq).transpose(*reversed(range(len(axes))), len(axes))
        np.matmul(e, src.reshape(*done, a.filter, rest), out=dst)
        src, done = dst, (*done, freqs[i])


def _filter_inverse(
    p: ConvProblem,
    spectrum: np.ndarray,
    grid: tuple[int, ...],
    ws: dict[str, np.ndarray],
    out: np.ndarray,
    alpha: float,
    beta: float,
) -> None:
    """out (k, c/g, taps...) = alpha * (real inverse DFT of spectrum (freqs..., k, c/g) at the
    filter taps) + beta * out, without the 1/N: the ortho forward transforms carry it. One GEMM per
    axis, the first axis first."""
    axes, freqs = p.axes, _frequencies(grid)
    lw = grid[-1]
    # A real signal's spectrum keeps the last axis' frequencies 0..lw/2: the others are conjugates,
    # so the inverse counts each kept one twice except 0 and (for even lw) lw/2, and keeps the real part.
    weights = np.full(freqs[-1], 2.0)
    weights[0] = 1.0
    if lw % 2 == 0:
        weights[-1] = 1.0
    kc = math.prod(spectrum.shape[len(axes) :])
    src: np.ndarray = spectrum
    done: tuple[int, ...] = ()
    for i, a in enumerate(axes):  # src: (taps of the axes done..., freqs of axis i, the rest)
        last = i == len(axes) - 1
        inverse = ws[f"inv{i}"]
        _dft_rows(
            inverse,
            freqs[i],
            a.filter,
            a.dilation,
            -a.pad,
            grid[i],
            1.0,
            ws["phase"],
            taps_first=True,
            weights=weights if last else None,
        )
        rest = math.prod(freqs[i + 1 :]) * kc
        dst = ws["t" if last else f"u{i}"].reshape(*done, a.filter, rest)
        np.matmul(inverse, src.reshape(*done, freqs[i], rest), out=dst)
        src, done = dst, (*done, a.filter)
    dims = len(axes)
    _blend(
        out, ws["t"].real.reshape(*done, *spectrum.shape[dims:]).transpose(dims, dims + 1, *range(dims)), alpha, beta
    )


def _fft_layout(p: ConvProblem) -> _Layout:
    dt = np.dtype(p.dtype)
    cdt = _complex_dtype(dt)
    axes, grid = p.axes, _fft_grid(p)
    freq = _frequencies(grid)
    lw, lwr = grid[-1], freq[-1]
    cg = p.c // p.groups
    taps = [a.filter for a in axes]
    sizes, outs = [a.size for a in axes], [a.out for a in axes]
    lay = _Layout()

    def image_scratch(prefix, lead, rows, col_step):
        spread = [(prefix + "_real", (*lead, *rows, lw), dt)] if col_step != 1 else []
        return [*spread, (prefix + "_half", (*lead, *rows, lwr), cdt)]

    def output_scratch(lead, rows):
        return [("out_half", (*lead, *rows, lwr), cdt), ("out_real", (*lead, *rows, lw), dt)]

    lay.add("phase", (max(freq) * max(taps),), np.float64)
    if p.kind == "bwd_filter":
        for i in range(len(axes)):
            lay.add(f"inv{i}", (taps[i], freq[i]), cdt)
        lay.add("xf", (*freq, p.n, p.c), cdt)
        lay.add("dyf", (*freq, p.n, p.k), cdt)
        lay.add("dwf", (*freq, p.k, cg), cdt)
        # the inverse's stages: taps of the axes done, then the frequencies of those still to do
        stages = [(f"u{i}", (*taps[: i + 1], *freq[i + 1 :], p.k, cg), cdt) for i in range(len(axes) - 1)]
        lay.overlay(
            image_scratch("x", (p.n, p.c), sizes[:-1], 1),
            image_scratch("dy", (p.n, p.k), outs[:-1], axes[-1].stride),
            [*stages, ("t", (*taps, p.k, cg), cdt)],
        )
        return lay
    for i in range(len(axes)):
        lay.add(f"e{i}", (freq[i], taps[i]), cdt)
    # the filter transform's stages: frequencies of the axes done (last first), then taps still to do
    stages = [(f"z{i}", (*freq[: i - 1 : -1], *taps[:i], p.k, cg), cdt) for i in range(len(axes) - 1, 0, -1)]
    filter_scratch = [("wc", (*taps, p.k, cg), cdt), *stages]
    if p.kind == "fwd":
        lay.add("kf", (*freq, cg, p.k), cdt)
        lay.add("xf", (*freq, p.n, p.c), cdt)
        lay.add("yf", (*freq, p.n, p.k), cdt)
        lay.overlay(
            filter_scratch, image_scratch("x", (p.n, p.c), sizes[:-1], 1), output_scratch((p.n, p.k), outs[:-1])
        )
    else:
        lay.add("kf", (*freq, p.k, cg), cdt)
        lay.add("dyf", (*freq, p.n, p.k), cdt)
        lay.add("dxf", (*freq, p.n, p.c), cdt)
        lay.overlay(
            filter_scratch,
            image_scratch("dy", (p.n, p.k), outs[:-1], axes[-1].stride),
            output_scratch((p.n, p.c), sizes[:-1]),
        )
    return lay


def _run_fft(p: ConvProblem, ws: dict[str, np.ndarray], x, w, dy, out, alpha: float, beta: float) -> None:
    grid = _fft_grid(p)
    nf = math.prod(_frequencies(grid))
    g, kg, cg = p.groups, p.k // p.groups, p.c // p.groups
    strides = tuple(a.stride for a in p.axes)
    ones = (1,) * len(strides)
    flipped = tuple(range(len(strides) + 1, 1, -1))  # the filter's spatial axes, last first

    def by_group(name: str, rows: int, cols: int) -> np.ndarray:  # (nf, g, rows, cols/g) matrices
        return ws[name].reshape(nf, rows, g, cols // g).transpose(0, 2, 1, 3)

    if p.kind == "fwd":
        _filter_spectrum(p, w.transpose(*flipped, 1, 0), grid, ws, ws["kf"], conjugate=True)  # kf: (.., cg, k)
        _image_spectrum(x, ones, grid, None, ws["x_half"], ws["xf"])
        np.matmul(by_group("xf", p.n, p.c), by_group("kf", cg, p.k), out=by_group("yf", p.n, p.k))
        _image_inverse(ws["yf"], strides, grid, ws["out_half"], ws["out_real"], out, alpha, beta)
    elif p.kind == "bwd_data":
        _filter_spectrum(p, w.transpose(*flipped, 0, 1), grid, ws, ws["kf"], conjugate=False)
        _image_spectrum(dy, strides, grid, ws.get("dy_real"), ws["dy_half"], ws["dyf"])
        np.matmul(by_group("dyf", p.n, p.k), ws["kf"].reshape(nf, g, kg, cg), out=by_group("dxf", p.n, p.c))
        _image_inverse(ws["dxf"], ones, grid, ws["out_half"], ws["out_real"], out, alpha, beta)
    else:
        _image_spectrum(x, ones, grid, None, ws["x_half"], ws["xf"])
        _image_spectrum(dy, strides, grid, ws.get("dy_real"), ws["dy_half"], ws["dyf"], conjugate=True)
        dyf_t = by_group("dyf", p.n, p.k).transpose(0, 1, 3, 2)  # (nf, g, kg, n)
        np.matmul(dyf_t, by_group("xf", p.n, p.c), out=ws["dwf"].reshape(nf, g, kg, cg))
        _filter_inverse(p, ws["dwf"], grid, ws, out, alpha, beta)
