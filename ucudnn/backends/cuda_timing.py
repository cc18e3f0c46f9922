"""Back-to-back timing of GPU kernels: how many launches one sample takes, and the spin kernel that
holds the stream while the host queues them, so the ~50 us of Python per launch never sits between
kernels."""

from __future__ import annotations

import functools
import math
from typing import Any

# Back-to-back timing: launches per sample so that one sample spans about this much kernel time,
# at most this many; the stream is held for HOST_MS_PER_LAUNCH per launch (capped) while the host
# queues them.
SAMPLE_TARGET_MS = 2.0
MAX_LAUNCHES_PER_SAMPLE = 64
HOST_MS_PER_LAUNCH = 0.1
MAX_HOLD_MS = 10.0


def launches_per_sample(single_ms: float) -> int:
    """Back-to-back launches per timing sample for a kernel that took `single_ms` alone."""
    if not single_ms > 0:
        return MAX_LAUNCHES_PER_SAMPLE
    return max(1, min(MAX_LAUNCHES_PER_SAMPLE, math.ceil(SAMPLE_TARGET_MS / single_ms)))


_HOLD_SOURCE = r"""
extern "C" __global__ void ucudnn_hold(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


@functools.cache
def _hold_kernel() -> Any:
    """A one-thread kernel that spins for a number of clock cycles, holding the stream."""
    import cupy

    return cupy.RawKernel(_HOLD_SOURCE, "ucudnn_hold")
