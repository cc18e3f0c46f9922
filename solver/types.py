"""The values every solver speaks: a measured micro-config and a configuration of them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ucudnn.errors import UcudnnError


class Infeasible(UcudnnError, ValueError):
    """No configuration satisfies the limits; the message says which limit and by how much."""


@dataclass(frozen=True, slots=True)
class MicroConfig:
    """One algorithm run at one micro-batch size: its measured time (ms) and workspace (bytes).

    A candidate that cannot run is kept as data: `time` is infinite and `reason` says why.
    `spread` (the interquartile range of the timing samples, ms) is informative and not part of
    equality.
    """

    algo: str
    batch: int
    time: float
    workspace: int
    reason: str = field(default="", compare=False)
    spread: float = field(default=0.0, compare=False)

    @property
    def usable(self) -> bool:
        return math.isfinite(self.time)


@dataclass(frozen=True, slots=True)
class Configuration:
    """Micro-configs run one after another: time is the sum, workspace the max (shared buffer).

    Both are computed once on construction: solvers read them millions of times.
    """

    micros: tuple[MicroConfig, ...]
    time: float = field(init=False, compare=False)
    workspace: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "time", sum(m.time for m in self.micros))
        object.__setattr__(self, "workspace", max((m.workspace for m in self.micros), default=0))

    @property
    def batch(self) -> int:
        return sum(m.batch for m in self.micros)

    def describe(self) -> str:
        """`2x16:im2col_gemm + 1x8:fft`, grouping equal consecutive micro-configs."""
        groups: list[list] = []
        for m in self.micros:
            if groups and groups[-1][1] == m:
                groups[-1][0] += 1
            else:
                groups.append([1, m])
        return " + ".join(f"{count}x{m.batch}:{m.algo}" for count, m in groups)
