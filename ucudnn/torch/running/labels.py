"""The category a storage allocated now is counted under, for whoever counts memory.

The executor allocates its host copies inside `allocated_as("host")`; a memory tracker
(`ucudnn.torch.checking.tracker`) files what it sees allocated by `current_label()`. A context variable, not
tracker state, so that the executor labels its buffers without knowing of trackers.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from ucudnn.errors import InvalidInput

__all__ = ["CATEGORIES", "allocated_as", "check_category", "current_label"]

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
