"""The category a storage allocated now is counted under, for whoever counts memory.

The executor allocates its host copies inside `allocated_as("host")`; a memory tracker
(`ucudnn.torch.checking.tracker`) files what it sees allocated by `current_label()`. A context variable, not
tracker state, so that the executor labels its buffers without knowing of trackers.

Inductor's generated CPU code allocates its buffers outside PyTorch's dispatch, with a function it binds as the
code loads: `watch_inductor_buffers` wraps that function (before anything compiles) and hands each buffer to the
trackers counting now (`watching`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

from ucudnn.errors import InvalidInput

__all__ = ["CATEGORIES", "allocated_as", "check_category", "current_label", "watch_inductor_buffers", "watching"]

CATEGORIES = ("weight", "weight_grad", "tensor", "workspace", "host")

_LABEL: contextvars.ContextVar[str | None] = contextvars.ContextVar("ucudnn_tracker_label", default=None)


@contextlib.contextmanager
def allocated_as(category: str) -> Iterator[None]:
    """File the storages allocated inside this block under `category` (one of `CATEGORIES`)."""
    check_category(category)
    token = _LABEL.set(category)
    try:
        yield
    finally:
        _LABEL.reset(token)


def check_category(category: str) -> None:
    """Refuse a category that is not one of `CATEGORIES`, in one line."""
    if category not in CATEGORIES:
        raise InvalidInput(f"category must be one of {', '.join(CATEGORIES)}, got {category!r}")


def current_label() -> str | None:
    """The category of the innermost `allocated_as` block around this call (None outside every one)."""
    return _LABEL.get()


_ALLOCATE = "_empty_strided_cpu"  # what Inductor's CPU code binds as it loads
# What is told of each buffer Inductor's CPU code allocates (`watching`), innermost last.
_WATCHERS: list[Callable[[Any], None]] = []


def watch_inductor_buffers() -> None:
    """Wrap Inductor's CPU allocation function (`torch._C._dynamo.guards._empty_strided_cpu`), once per process,
    so that the buffers of code compiled from now on reach `watching`'s callbacks. Costs a Python call per buffer
    (a CPU step's few hundred: tens of microseconds); CUDA code allocates through the caching allocator, unwrapped."""
    from torch._C._dynamo import guards

    original = getattr(guards, _ALLOCATE)
    if getattr(original, "ucudnn_watched", False):
        return

    def allocate(*args: Any, **kwargs: Any) -> Any:
        t = original(*args, **kwargs)
        for watcher in _WATCHERS:
            watcher(t)
        return t

    allocate.ucudnn_watched = True  # type: ignore[attr-defined]
    setattr(guards, _ALLOCATE, allocate)


@contextlib.contextmanager
def watching(callback: Callable[[Any], None]) -> Iterator[None]:
    """Inside this block, `callback(buffer)` for each buffer Inductor's CPU code allocates (see
    `watch_inductor_buffers`)."""
    _WATCHERS.append(callback)
    try:
        yield
    finally:
        _WATCHERS.remove(callback)
