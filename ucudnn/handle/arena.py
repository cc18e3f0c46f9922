"""Where a kernel's workspace lives: WD segments placed aligned and disjoint in one arena, WR's one
shared buffer grown to the largest kernel, or a memory plan's budget taken for one run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ucudnn.backends.base import Backend
from ucudnn.handle.kernel import _Prepared, native_only
from ucudnn.solver.types import Configuration

# WD segments start at multiples of this: cuDNN wants aligned workspace pointers, and on the CPU an
# aligned start keeps float views of a segment on cache-line (and SIMD) boundaries.
SEGMENT_ALIGN_BYTES = 256


def _align_up(nbytes: int) -> int:
    return -(-nbytes // SEGMENT_ALIGN_BYTES) * SEGMENT_ALIGN_BYTES


def _place_segments(configs: Sequence[Configuration]) -> tuple[list[int], int]:
    """Aligned, disjoint arena offsets for the kernels' workspaces, and the bytes they span."""
    offsets, end = [], 0
    for config in configs:
        if config.workspace == 0:
            offsets.append(0)  # an empty segment; it overlaps nothing
            continue
        start = _align_up(end)
        offsets.append(start)
        end = start + config.workspace
    return offsets, end


class _Workspaces:
    """The Handle's workspace for each run (a mixin of `Handle`, whose buffer and arena it holds)."""

    # the Handle's state it uses (`Handle.__init__` says what each is)
    _backend: Backend
    _total_workspace: int | None
    _buffer: Any
    _buffer_bytes: int
    _arena: Any
    _slices: tuple[Any, dict]
    _peak_bytes: int

    def _workspace(self, prep: _Prepared) -> Any:
        need = prep.config.workspace
        if native_only(prep.config):  # torch allocates its own temporaries: its declared size is an estimate
            return self._backend.empty_workspace(0)
        if prep.budget is not None:  # a plan's budget: held for this run only, as the plan counted it
            return self._backend.empty_workspace(need)
        if self._backend.workspace_per_run:  # WR or WD, taken for this run only (`Backend.workspace_per_run`)
            self._peak_bytes = max(self._peak_bytes, need)
            return self._backend.empty_workspace(need)
        if prep.offset is not None:
            if self._arena is None:  # freed by close(); the plans still hold
                assert self._total_workspace is not None  # an offset is a WD segment
                self._arena = self._backend.empty_workspace(self._total_workspace)
            return self._slice(self._arena, prep.offset, need)
        if self._buffer is None or need > self._buffer_bytes:
            self._buffer = None  # release the old buffer before taking the larger one
            self._buffer = self._backend.empty_workspace(need)
            self._buffer_bytes = need
            self._peak_bytes = max(self._peak_bytes, need)
        return self._slice(self._buffer, 0, need)

    def _slice(self, base: Any, start: int, need: int) -> Any:
        """`base[start:start + need]`, the same array object on every run while `base` stays: a backend's
        prepared launcher keeps what it carved from it (see `CpuBackend.prepare_run`)."""
        if self._slices[0] is not base:
            self._slices = (base, {})
        views = self._slices[1]
        view = views.get((start, need))
        if view is None:
            view = views[start, need] = base[start : start + need]
        return view
