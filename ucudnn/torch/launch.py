"""How a planned kernel runs on torch tensors: which dtypes and layouts reach the handle, the tensors
viewed as the handle's arrays without copies (NumPy on the CPU, CuPy on CUDA), and on CUDA torch's
current stream and caching allocator. The layer's autograd Function (`ucudnn.torch.conv`) and the
operators (`ucudnn.torch.ops`) both launch through it, so neither imports the other to run a kernel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ucudnn.backends.base import one_line
from ucudnn.errors import BackendUnavailable, InvalidInput, UnsupportedProblem
from ucudnn.handle import Kernel

# dtypes that reach the handle, by device; others are refused with a message naming the dtype and
# the backend (the cpu backend computes in float32 and float64; on CUDA, bfloat16 tensors reach
# CuPy, which has no bfloat16, as their raw 16-bit words).
_DTYPES = {"cpu": {torch.float32: "float32", torch.float64: "float64"},
           "cuda": {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
                    torch.bfloat16: "bfloat16"}}


def _dtype_name(t: torch.Tensor, backend_name: str) -> str:
    names = _DTYPES.get(t.device.type)
    if names is None:
        raise UnsupportedProblem(f"ucudnn.torch.Conv2d runs CPU or CUDA tensors, got a tensor on {t.device}")
    name = names.get(t.dtype)
    if name is None:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in names)
        autocast = (" (torch.autocast casts convolutions to it; disable autocast around this model)"
                    if t.dtype in (torch.float16, torch.bfloat16) else "")
        raise UnsupportedProblem(f"ucudnn.torch.Conv2d: the {backend_name} backend cannot run "
                                 f"{str(t.dtype).removeprefix('torch.')} tensors on {t.device.type}{autocast}; it "
                                 f"runs {allowed} there. Convert the model with .float() or keep this layer a "
                                 "torch.nn.Conv2d")
    return name


def _as_array(t: torch.Tensor, backend_name: str) -> Any:
    """A view of a tensor as the handle's array type (NumPy on the CPU, CuPy on CUDA), no copy."""
    t = t.detach()
    if t.device.type == "cpu":
        if backend_name != "cpu":
            raise InvalidInput(f"a CPU tensor reached a handle of backend {backend_name!r}; "
                               "give the model a handle with backend='cpu' (or move the model to the GPU)")
        return t.numpy()
    if t.device.type == "cuda":  # pragma: no cover - needs a GPU
        if backend_name != "cudnn":
            raise InvalidInput(f"a CUDA tensor reached a handle of backend {backend_name!r}; "
                               "give the model a handle with backend='cudnn' or 'auto'")
        try:
            import cupy
        except ImportError as exc:
            raise BackendUnavailable("CUDA tensors need CuPy: pip install 'ucudnn[cuda]'") from exc
        if t.dtype == torch.bfloat16:  # the backend stores bfloat16 as uint16 words
            return cupy.asarray(t.view(torch.int16)).view(cupy.uint16)
        return cupy.asarray(t)  # zero-copy through __cuda_array_interface__
    raise UnsupportedProblem(f"ucudnn.torch.Conv2d runs CPU or CUDA tensors, got a tensor on {t.device}")


def _torch_allocator(device_index: int):  # pragma: no cover - needs a GPU
    """A CuPy allocator that takes its memory from PyTorch's caching allocator: workspaces and
    temporaries then show in torch.cuda.max_memory_allocated, and no second pool holds memory.
    A CuPy pointer owns the torch tensor it views, so the block returns to torch with it."""
    import cupy

    device = torch.device("cuda", device_index)

    def allocate(nbytes: int):
        try:
            block = torch.empty(nbytes, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError as exc:  # a RuntimeError: the handle would record the algorithm unusable for good
            raise MemoryError(f"torch's caching allocator: {one_line(exc)}") from exc
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(block.data_ptr(), nbytes, block, device_index), 0)

    return allocate


_ALLOCATORS: dict[int, Any] = {}


_NOTHING = contextlib.nullcontext()


def _on_device(t: torch.Tensor):
    """CUDA: CuPy work on torch's current stream (so that it orders with torch's kernels) and
    CuPy allocations from torch's caching allocator. CPU: nothing."""
    return _NOTHING if t.device.type != "cuda" else _on_cuda(t)


@contextlib.contextmanager
def _on_cuda(t: torch.Tensor) -> Iterator[None]:  # pragma: no cover - needs a GPU
    import cupy

    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    allocator = _ALLOCATORS.get(index) or _ALLOCATORS.setdefault(index, _torch_allocator(index))
    stream = torch.cuda.current_stream(t.device)
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream, index), \
            cupy.cuda.using_allocator(allocator):
        yield


def _out_size(size: int, r: int, stride: int, pad: int, dilation: int) -> int:
    return (size + 2 * pad - dilation * (r - 1) - 1) // stride + 1


def _memory_format(layout: str) -> torch.memory_format:
    return torch.channels_last if layout == "NHWC" else torch.contiguous_format


def _launch(kernel: Kernel, backend: str, out: torch.Tensor, **operands: torch.Tensor) -> torch.Tensor:
    """Run a planned kernel on tensors (viewed as the handle's arrays) into `out`; returns `out`."""
    with _on_device(out):
        kernel.run(out=_as_array(out, backend), **{name: _as_array(t, backend) for name, t in operands.items()})
    return out
