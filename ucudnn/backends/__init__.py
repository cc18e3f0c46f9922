"""Convolution backends: `cpu` (NumPy/SciPy, plus PyTorch's own as `native`) and `cudnn`."""

from __future__ import annotations

import logging

from ucudnn.backends.base import Backend, DeviceInfo
from ucudnn.errors import BackendUnavailable, InvalidInput

log = logging.getLogger(__name__)

BACKENDS = ("auto", "cpu", "cudnn")


def get_backend(name: str = "auto") -> Backend:
    """`cpu`, `cudnn`, or `auto` (cudnn when a GPU and libcudnn can be used, else cpu)."""
    if name == "cpu":
        from ucudnn.backends.cpu import CpuBackend

        return CpuBackend()
    if name == "cudnn":
        from ucudnn.backends.cudnn import CudnnBackend

        return CudnnBackend()
    if name == "auto":
        try:
            backend = get_backend("cudnn")
        except BackendUnavailable as exc:
            log.info("backend auto: chose cpu because cudnn is unavailable: %s", exc)
            return get_backend("cpu")
        versions = dict(backend.device.versions)
        log.info(
            "backend auto: chose cudnn because CuPy sees %s and libcudnn %s loads",
            backend.device.model,
            versions.get("cudnn", "(version unknown)"),
        )
        return backend
    raise InvalidInput(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Backend", "DeviceInfo", "get_backend"]
