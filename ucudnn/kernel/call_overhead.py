"""Charging the caller's per-call cost when choosing a plan.

Measurements time the bare kernel. A framework that can run one configuration itself, `native`
(PyTorch's own convolution) on the whole batch, pays nothing extra for it; every other
configuration it must route through ucudnn (``ucudnn.torch``: a custom autograd Function, array
views, an output tensor, the handle's launch), which costs host time per kernel call that no
measurement sees. With a handle's ``call_overhead`` (ms per kernel call) the choice charges that
cost to every configuration except native undivided, so a NumPy algorithm is chosen only where it
wins including it. WR re-times its choice against native undivided, interleaved, and keeps it
only where it wins by more than the charge (`confirm_faster(..., charge_ms=...)`); WD solves over
fronts whose configurations carry the charge (`charged_fronts`). The stored plans keep their
measured times: the charge only decides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from ucudnn.backends.cpu import NATIVE
from ucudnn.solver.types import Configuration, MicroConfig

__all__ = ["charged_fronts", "native_undivided"]

Table = Mapping[int, Sequence[MicroConfig]]


def native_undivided(table: Table, batch: int, limit: int | None) -> Configuration | None:
    """`native` on the whole batch, when it was measured usable within `limit`; else None."""
    for m in table.get(batch, ()):
        if m.algo == NATIVE and m.usable and (limit is None or m.workspace <= limit):
            return Configuration((m,))
    return None


def _charged(config: Configuration, overhead_ms: float) -> Configuration:
    """`config` with `overhead_ms` added to its time (on its first micro-config): what its caller pays."""
    first = config.micros[0]
    return Configuration((replace(first, time=first.time + overhead_ms), *config.micros[1:]))


def charged_fronts(
    fronts: Mapping[str, Sequence[Configuration]],
    tables: Mapping[str, Table],
    batch: int,
    limit: int | None,
    overhead_ms: float,
) -> tuple[dict[str, list[Configuration]], dict[int, Configuration]]:
    """WD: each front as its caller pays for it, with native undivided added uncharged (it may have
    been dominated before the charge), and the charged configurations' originals by ``id``.
    `wd.solve` returns the objects it was given and ignores dominated ones, so the caller maps its
    choice back with ``originals.get(id(chosen), chosen)``."""
    out: dict[str, list[Configuration]] = {}
    originals: dict[int, Configuration] = {}
    for key, front in fronts.items():
        native = native_undivided(tables[key], batch, limit)
        charged = []
        for config in front:
            if native is not None and config.micros == native.micros:
                continue
            paid = _charged(config, overhead_ms)
            originals[id(paid)] = config
            charged.append(paid)
        out[key] = charged + ([native] if native is not None else [])
    return out, originals
