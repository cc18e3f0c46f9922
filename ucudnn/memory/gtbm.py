"""Dymem's GTBM pool against a best-fit pool, replayed on one allocation trace (Yang & Cheng 2020, 3.3).

A pool is one contiguous address range. Freed blocks coalesce with free neighbours, but a block
between two holes keeps them apart, so a request can fail although enough memory is free in total.
Dymem measures this with the unusable free space of a request of r bytes (its equation 1, with the
buddy sizes 2^i generalised to any hole size):

    U_f(r) = (TotalFree - sum of the free holes of at least r bytes) / TotalFree

0 means every free byte could serve the request; 1 means none could.

- `BestFitPool`: CNMeM's default (vDNN, SuperNeurons): the smallest hole that fits, low end first.
- `GTBMPool`: Group Tensors By Mobility. *Movable* tensors (one consumer, used at once) are placed
  best-fit from the low end; *temporary* tensors (forks, tensors waiting for a join) best-fit from
  the high end of a hole, so they are freed roughly in the reverse order of allocation and leave
  no holes among the movable ones; *reclaimed* tensors (FC, softmax, loss outputs, and maps kept
  resident instead of offloaded: the paper's "layers not selected for offloading") go
  to the incremental space, exact-size allocations outside the pool (cudaMalloc).

Hand-written: no library models an address-ordered free list with the paper's placement rules.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ucudnn.errors import InvalidInput

__all__ = [
    "MOBILITIES",
    "Alloc",
    "BestFitPool",
    "Comparison",
    "Free",
    "GTBMPool",
    "PoolReport",
    "compare",
    "minimal_capacity",
    "replay",
    "unusable_free",
]

MOBILITIES = ("movable", "temporary", "reclaimed")


@dataclass(frozen=True, slots=True)
class Alloc:
    """A request for `bytes` bytes for tensor `name`, with Dymem's mobility class (Algorithm 3)."""

    name: str
    bytes: int
    mobility: str = "movable"

    def __post_init__(self) -> None:
        if isinstance(self.bytes, bool) or not isinstance(self.bytes, int) or self.bytes <= 0:
            raise InvalidInput(f"allocation {self.name!r}: bytes must be a positive integer, got {self.bytes!r}")
        if self.mobility not in MOBILITIES:
            raise InvalidInput(
                f"allocation {self.name!r}: mobility must be one of {', '.join(MOBILITIES)}, got {self.mobility!r}"
            )


@dataclass(frozen=True, slots=True)
class Free:
    name: str


Event = Alloc | Free


def unusable_free(holes: Iterable[int], request: int) -> float:
    """U_f(request) over free holes of the given sizes (1 when nothing is free)."""
    sizes = list(holes)
    total = sum(sizes)
    if total == 0:
        return 1.0
    return (total - sum(h for h in sizes if h >= request)) / total


class _Arena:
    """Free holes of [0, capacity) as sorted (start, end) pairs, coalesced on release.

    Mutable by design: a pool is replayed once, event by event, inside `replay`."""

    def __init__(self, capacity: int) -> None:
        self.holes: list[tuple[int, int]] = [(0, capacity)] if capacity > 0 else []

    def hole_sizes(self) -> list[int]:
        return [end - start for start, end in self.holes]

    def take(self, index: int, size: int, high: bool) -> int:
        start, end = self.holes.pop(index)
        if high:
            address = end - size
            if address > start:
                self.holes.insert(index, (start, address))
        else:
            address = start
            if start + size < end:
                self.holes.insert(index, (start + size, end))
        return address

    def release(self, address: int, size: int) -> None:
        start, end = address, address + size
        i = bisect.bisect_left(self.holes, (start, end))
        if i > 0 and self.holes[i - 1][1] == start:  # merge with the hole below
            start = self.holes.pop(i - 1)[0]
            i -= 1
        if i < len(self.holes) and self.holes[i][0] == end:  # and the one above
            end = self.holes.pop(i)[1]
        self.holes.insert(i, (start, end))

    def best_fit(self, size: int, high: bool = False) -> int | None:
        """Index of the smallest hole of at least `size` bytes (ties: lowest, or highest when `high`)."""
        best = None
        for i, (start, end) in enumerate(self.holes):
            hole = end - start
            if hole >= size and (best is None or hole < best[0] or (high and hole == best[0])):
                best = (hole, i)
        return None if best is None else best[1]


class BestFitPool:
    """CNMeM's best-fit placement over one arena of `capacity` bytes."""

    name = "best-fit"

    def __init__(self, capacity: int) -> None:
        self.main = _Arena(capacity)

    def place(self, request: Alloc) -> tuple[str, int] | None:
        i = self.main.best_fit(request.bytes)
        return None if i is None else ("main", self.main.take(i, request.bytes, high=False))

    def release(self, arena: str, address: int, size: int) -> None:
        self.main.release(address, size)


class GTBMPool:
    """Dymem's unified pool: main space of `capacity` bytes (movable low, temporary high), and an
    incremental space for reclaimed tensors that never fragments (exact-size allocations)."""

    name = "gtbm"

    def __init__(self, capacity: int) -> None:
        self.main = _Arena(capacity)

    def place(self, request: Alloc) -> tuple[str, int] | None:
        if request.mobility == "reclaimed":
            return ("incremental", 0)
        if request.mobility == "temporary":
            # cnmemHighMalloc: CNMeM's best-fit search, the block carved from its high end. (The other
            # reading, the highest hole that fits, fragments DenseNet's growing concatenations more.)
            i = self.main.best_fit(request.bytes, high=True)
            return None if i is None else ("main", self.main.take(i, request.bytes, high=True))
        i = self.main.best_fit(request.bytes)
        return None if i is None else ("main", self.main.take(i, request.bytes, high=False))

    def release(self, arena: str, address: int, size: int) -> None:
        if arena == "main":
            self.main.release(address, size)


@dataclass(frozen=True, slots=True)
class PoolReport:
    """One replay: whether every request was served, and U_f at each main-space request."""

    pool: str
    capacity: int  # main space bytes
    fits: bool
    failed: int  # requests no hole could serve
    incremental_peak_bytes: int  # reclaimed tensors' peak (GTBM only; 0 for best-fit)
    mean_unusable: float  # mean U_f over the main-space requests, measured before placing each
    max_unusable: float


def _check_trace(trace: Sequence[Event]) -> None:
    live = set()
    for k, event in enumerate(trace):
        if isinstance(event, Alloc):
            if event.name in live:
                raise InvalidInput(f"trace[{k}]: tensor {event.name!r} is allocated twice without a free")
            live.add(event.name)
        elif isinstance(event, Free):
            if event.name not in live:
                raise InvalidInput(f"trace[{k}]: tensor {event.name!r} is freed but not allocated")
            live.remove(event.name)
        else:
            raise InvalidInput(f"trace[{k}] must be an Alloc or a Free, got {type(event).__name__}")


def replay(trace: Sequence[Event], pool: BestFitPool | GTBMPool) -> PoolReport:
    """Run `trace` through `pool`. A request that fails is recorded and skipped (its free too);
    requests that go to GTBM's incremental space are not main-space requests and have no U_f.
    """
    _check_trace(trace)
    where: dict[str, tuple[str, int, int]] = {}
    unusable: list[float] = []
    failed = incremental = incremental_peak = 0
    for event in trace:
        if isinstance(event, Free):
            held = where.pop(event.name, None)
            if held is not None:
                arena, address, size = held
                if arena == "incremental":
                    incremental -= size
                pool.release(arena, address, size)
            continue
        main_request = not (isinstance(pool, GTBMPool) and event.mobility == "reclaimed")
        if main_request:
            unusable.append(unusable_free(pool.main.hole_sizes(), event.bytes))
        placed = pool.place(event)
        if placed is None:
            failed += 1
            continue
        where[event.name] = (placed[0], placed[1], event.bytes)
        if placed[0] == "incremental":
            incremental += event.bytes
            incremental_peak = max(incremental_peak, incremental)
    capacity = sum(pool.main.hole_sizes()) + sum(size for arena, _, size in where.values() if arena == "main")
    return PoolReport(
        pool.name,
        capacity,
        failed == 0,
        failed,
        incremental_peak,
        sum(unusable) / len(unusable) if unusable else 0.0,
        max(unusable, default=0.0),
    )


def _peak_live(trace: Sequence[Event], main_only: bool = False) -> int:
    """The peak of live bytes; with `main_only`, of the tensors GTBM keeps in its main space."""
    sizes: dict[str, int] = {}
    live = peak = 0
    for event in trace:
        if isinstance(event, Alloc):
            sizes[event.name] = 0 if main_only and event.mobility == "reclaimed" else event.bytes
            live += sizes[event.name]
            peak = max(peak, live)
        else:
            live -= sizes.pop(event.name)
    return peak


def minimal_capacity(trace: Sequence[Event], pool_type: type[BestFitPool | GTBMPool]) -> int:
    """The smallest main-space size (found by bisection) at which `trace` replays without a failure.

    The answer lies between the peak of live bytes (no pool does better) and the sum of all
    requests (there the untouched space between the low and the high ends always fits the next
    request). Placement depends on the capacity, so success need not be
    monotone in it; the returned capacity is checked to succeed.
    """
    _check_trace(trace)
    lo = _peak_live(trace, main_only=pool_type is GTBMPool)
    hi = sum(e.bytes for e in trace if isinstance(e, Alloc))
    if lo == 0:
        return 0
    if replay(trace, pool_type(lo)).fits:
        return lo
    while hi - lo > 1:  # invariant: lo fails, hi fits
        mid = (lo + hi) // 2
        if replay(trace, pool_type(mid)).fits:
            hi = mid
        else:
            lo = mid
    return hi


@dataclass(frozen=True, slots=True)
class Comparison:
    """Best-fit and GTBM on one trace: each one's smallest pool, and U_f at a capacity both fit in."""

    peak_live_bytes: int
    best_fit_bytes: int  # smallest best-fit pool
    gtbm_bytes: int  # smallest GTBM main space + its incremental space's peak
    capacity: int  # the main-space size both replays below ran with
    best_fit: PoolReport
    gtbm: PoolReport


def compare(trace: Sequence[Event]) -> Comparison:
    """Replay `trace` on both pools at the same capacity: the larger of their two smallest pools."""
    best_fit_min = minimal_capacity(trace, BestFitPool)
    gtbm_min = minimal_capacity(trace, GTBMPool)
    capacity = max(best_fit_min, gtbm_min)
    gtbm = replay(trace, GTBMPool(capacity))
    return Comparison(
        _peak_live(trace),
        best_fit_min,
        gtbm_min + gtbm.incremental_peak_bytes,
        capacity,
        replay(trace, BestFitPool(capacity)),
        gtbm,
    )
