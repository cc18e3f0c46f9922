"""Device profiles: what a GPU offers, for planning without that GPU at hand.

A profile holds a device's memory capacity, its host link (bandwidth each way and both at once, and
how many devices share that link), and its compute and memory throughput. The memory planner
(`ucudnn.memory`) and the cluster optimizer (`ucudnn.best_batch_size`) take operation times from
the measurement cache where the device has measurements, and otherwise from `roofline_ms`.

Built-in profiles carry public specification figures (peak FP32 throughput, memory bandwidth and
capacity, PCIe generation), except where a figure was measured, which `source` says. A user adds a
device with a JSON file holding the same fields (`load_profile("my_gpu.json")`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TypedDict

from ucudnn.errors import InvalidInput

__all__ = ["PROFILES", "ROOFLINE_EFFICIENCY", "DeviceProfile", "load_profile", "profile_names"]

# A roofline estimate divides by peak throughput; real convolution, GEMM and elementwise kernels
# reach a fraction of it. Half of peak is a common middle ground for cuDNN's kernels on the GPUs
# here; a device with measurements never uses this number.
ROOFLINE_EFFICIENCY = 0.5

_GB = 10**9
_GIB = 2**30


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """One device model. Bandwidths in GB/s (10^9 bytes per second), throughput in TFLOP/s."""

    name: str  # short key: k40, h100, ...
    model: str  # the full model name
    memory_bytes: int  # device memory capacity
    h2d_gbps: float  # host-to-device copy bandwidth, one direction alone
    d2h_gbps: float  # device-to-host copy bandwidth, one direction alone
    duplex_gbps: float  # both directions at once, the two summed
    devices_per_link: int  # devices that share one host link (a PCIe switch), whose copies share it
    fp32_tflops: float  # peak FP32 arithmetic throughput
    memory_gbps: float  # device memory bandwidth
    source: str = "specification"
    # The device's memory is the host's (a CPU): a map offloaded "to the host" stays in the same
    # memory, so the planner never offloads there.
    shares_host_memory: bool = False

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise InvalidInput(f"a device profile needs a name, got {self.name!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "model", "source"):
                if not isinstance(value, str):
                    raise InvalidInput(f"device profile {self.name!r}: {f.name} must be text, got {value!r}")
                continue
            if f.name == "shares_host_memory":
                if not isinstance(value, bool):
                    raise InvalidInput(f"device profile {self.name!r}: {f.name} must be true or false, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
                raise InvalidInput(
                    f"device profile {self.name!r}: {f.name} must be a positive finite number, got {value!r}"
                )
        if not isinstance(self.memory_bytes, int) or not isinstance(self.devices_per_link, int):
            raise InvalidInput(f"device profile {self.name!r}: memory_bytes and devices_per_link must be integers")

    def copy_ms(self, nbytes: int, direction: str, concurrent: bool = False) -> float:
        """Time to copy `nbytes` over the host link ("h2d" or "d2h"), alone or while the other way copies too."""
        if direction not in ("h2d", "d2h"):
            raise InvalidInput(f"direction must be 'h2d' or 'd2h', got {direction!r}")
        gbps = self.duplex_gbps / 2 if concurrent else (self.h2d_gbps if direction == "h2d" else self.d2h_gbps)
        return nbytes / (gbps * _GB) * 1e3

    def roofline_ms(self, flops: float, bytes_moved: float) -> float:
        """An operation's time estimated from its arithmetic and its device-memory traffic."""
        compute_s = flops / (self.fp32_tflops * 1e12 * ROOFLINE_EFFICIENCY)
        memory_s = bytes_moved / (self.memory_gbps * _GB * ROOFLINE_EFFICIENCY)
        return max(compute_s, memory_s) * 1e3

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> DeviceProfile:
        if not isinstance(data, dict):
            raise InvalidInput(f"a device profile is a JSON object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise InvalidInput(
                f"device profile: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}"
            )
        missing = sorted(
            f.name for f in fields(cls) if f.name not in data and f.name not in ("source", "shares_host_memory")
        )
        if missing:
            raise InvalidInput(f"device profile {data.get('name', '?')!r}: missing field(s) {', '.join(missing)}")
        return cls(**data)


class _HostLink(TypedDict):
    """A host link's bandwidths, as `DeviceProfile` names them."""

    h2d_gbps: float
    d2h_gbps: float
    duplex_gbps: float


# PCIe 3.0 x16 moves about 12 GB/s each way with pinned memory (16 GB/s raw), about 20 GB/s both ways.
_PCIE3: _HostLink = {"h2d_gbps": 12.0, "d2h_gbps": 12.0, "duplex_gbps": 20.0}
# PCIe 2.0 x16: about 6 GB/s each way (8 GB/s raw).
_PCIE2: _HostLink = {"h2d_gbps": 6.0, "d2h_gbps": 6.0, "duplex_gbps": 10.0}

PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        # vDNN's machine (Rhu et al.): 12 GB, 288 GB/s, PCIe 3.
        DeviceProfile("k40", "Tesla K40", 12 * _GIB, devices_per_link=1, fp32_tflops=4.29, memory_gbps=288.0, **_PCIE3),
        DeviceProfile(
            "p100", "Tesla P100 PCIe 16GB", 16 * _GIB, devices_per_link=1, fp32_tflops=9.3, memory_gbps=732.0, **_PCIE3
        ),
        DeviceProfile(
            "v100", "Tesla V100 SXM2 16GB", 16 * _GIB, devices_per_link=1, fp32_tflops=15.7, memory_gbps=900.0, **_PCIE3
        ),
        DeviceProfile(
            "h100",
            "NVIDIA H100 80GB HBM3",
            80 * _GIB,
            h2d_gbps=54.9,
            d2h_gbps=55.0,
            duplex_gbps=91.0,
            devices_per_link=1,
            fp32_tflops=67.0,
            memory_gbps=3350.0,
            source="host link measured on an H100 (PCIe 5 x16), pinned memory; the rest specification",
        ),
        DeviceProfile("t4", "Tesla T4", 16 * _GIB, devices_per_link=1, fp32_tflops=8.1, memory_gbps=320.0, **_PCIE3),
        # The mu-cuDNN paper's cluster: a K80 is two GK210 chips behind one on-board PCIe switch.
        DeviceProfile(
            "gk210",
            "Tesla K80 (one GK210)",
            12 * _GIB,
            devices_per_link=2,
            fp32_tflops=4.37,
            memory_gbps=240.0,
            **_PCIE3,
        ),
        DeviceProfile(
            "k20xm", "Tesla K20Xm", 6 * _GIB, devices_per_link=1, fp32_tflops=3.95, memory_gbps=250.0, **_PCIE2
        ),
        DeviceProfile(
            "gtx750ti", "GeForce GTX 750 Ti", 2 * _GIB, devices_per_link=1, fp32_tflops=1.31, memory_gbps=86.4, **_PCIE3
        ),
    )
}


def profile_names() -> list[str]:
    """The built-in profiles' names, in a stable order."""
    return list(PROFILES)


def load_profile(name_or_path: str | Path) -> DeviceProfile:
    """A built-in profile by name (`k40`, `h100`, ...), or a user profile from a JSON file."""
    key = str(name_or_path)
    if key.lower() in PROFILES:
        return PROFILES[key.lower()]
    path = Path(key)
    if not key.endswith(".json") and not path.exists():
        raise InvalidInput(f"unknown device {key!r}; choose one of {', '.join(PROFILES)} or give a profile's JSON file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"cannot read device profile {key}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"device profile {key} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    try:
        return DeviceProfile.from_json(data)
    except TypeError as exc:
        raise InvalidInput(f"device profile {key}: {exc}") from None
