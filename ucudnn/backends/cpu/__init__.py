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

The package holds one module per family, each with its workspace layout beside it (`im2col`,
`shifted`, `fft`, `winograd`, `native`), what they share (`layout`, `common`), and the backend that
offers and launches them (`backend`).
"""

from __future__ import annotations

from ucudnn.backends.cpu.backend import (
    ALGORITHMS,
    FFT,
    IM2COL_GEMM,
    MEASUREMENT_PROTOCOL,
    NATIVE,
    NATIVE_MEASUREMENT_PROTOCOL,
    SHIFT_GEMM,
    SUPPORTED_DTYPES,
    WINOGRAD,
    CpuBackend,
)
from ucudnn.backends.cpu.fft import FFT_WORKERS
from ucudnn.backends.cpu.layout import ALIGN_BYTES

__all__ = [
    "ALGORITHMS",
    "ALIGN_BYTES",
    "FFT",
    "FFT_WORKERS",
    "IM2COL_GEMM",
    "MEASUREMENT_PROTOCOL",
    "NATIVE",
    "NATIVE_MEASUREMENT_PROTOCOL",
    "SHIFT_GEMM",
    "SUPPORTED_DTYPES",
    "WINOGRAD",
    "CpuBackend",
]
