"""The plan format: what the planner decides and the executor runs (JSON as in `ucudnn plan --json`).

Tensor names are the graph's: for a captured PyTorch step, a feature map is named after the module and
the operation that made it (``layer1.0.conv1:conv``, `ucudnn.torch.capturing.graph`); for a zoo network,
after its layer. Conv workspaces are named by the conv layer and the kernel (`fwd`, `bwd_data`, `bwd_filter`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ucudnn.errors import InvalidInput

__all__ = ["ACTIONS", "ConvWorkspace", "MemoryPlan", "TensorAction"]

# keep: resident from production to its last use; offload: copied to host after the forward pass
# uses it and prefetched before the backward pass does; recompute: freed and recomputed from the
# nearest kept tensor before its backward use; release: freed after its last forward use (the
# backward pass does not need it).
ACTIONS = ("keep", "offload", "recompute", "release")


@dataclass(frozen=True, slots=True)
class TensorAction:
    name: str
    bytes: int
    action: str

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise InvalidInput(f"tensor {self.name!r}: action must be one of {', '.join(ACTIONS)}, got {self.action!r}")


@dataclass(frozen=True, slots=True)
class ConvWorkspace:
    """One conv kernel's workspace budget. `torch_own`: the plan's option for it is torch's own convolution, which
    holds nothing the plan counts (its temporaries are torch's): a converted layer runs torch's kernel there,
    not whatever else of its own the budget would hold."""

    layer: str
    kind: str
    bytes: int
    torch_own: bool = False


def _tensors_json(tensors) -> list[dict]:
    return [{"name": t.name, "bytes": t.bytes, "action": t.action} for t in tensors]


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """One network, batch, device profile and memory limit: each tensor's action and each conv kernel's workspace."""

    network: str
    batch: int
    device: str
    devices: int
    memory_limit: int
    policy: str
    fits: bool
    peak_bytes: int
    average_bytes: int
    baseline_peak_bytes: int
    step_ms: float
    baseline_step_ms: float
    stall_ms: float
    bytes_offloaded: int
    tensors: tuple[TensorAction, ...]
    conv_workspace: tuple[ConvWorkspace, ...]
    # Which step of the policy's search gave the plan (vdnn-dyn: its pass, `vdnn.SEARCH_PASSES`); in
    # the JSON only when set.
    search: str = ""
    # Each device's tensors, for plans whose devices act differently (swap-multi staggers the swapped
    # layers over the GPUs of a switch); empty when every device does what `tensors` says, which is
    # then device 0's. `device_actions()` gives every device's either way.
    device_tensors: tuple[tuple[TensorAction, ...], ...] = ()
    # Planned for a compiled step (`ucudnn.torch.plan_memory(..., compiled=True)`): nothing offloaded, and
    # `peak_bytes` the compiled step's (`ucudnn.torch.planning.compiled_step`); in the JSON only when set.
    compiled: bool = False
    # The planner's simulation of this plan (`ucudnn.memory.simulate.SimResult`: timeline, memory over
    # the step), for plots; not part of the plan's JSON or of equality.
    simulation: Any = field(default=None, compare=False, repr=False)
    # The captured PyTorch step the plan was made for (`ucudnn.torch.capturing.capture.CapturedStep`), which its
    # executor follows; not part of the plan's JSON or of equality (a plan read back captures again).
    capture: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.device_tensors and len(self.device_tensors) != self.devices:
            raise InvalidInput(
                f"device_tensors: {len(self.device_tensors)} lists for {self.devices} devices "
                "(one per device, or none when every device does what tensors says)"
            )
        if self.device_tensors and self.device_tensors[0] != self.tensors:
            raise InvalidInput("device_tensors: the first list must be tensors (device 0's actions)")
        if all(ts == self.tensors for ts in self.device_tensors):
            object.__setattr__(self, "device_tensors", ())  # one form for "every device the same"

    @property
    def overhead(self) -> float:
        """step_ms / baseline_step_ms - 1."""
        return self.step_ms / self.baseline_step_ms - 1.0

    def action(self, name: str) -> str:
        """The action planned for tensor `name` (keep when the plan does not name it)."""
        for t in self.tensors:
            if t.name == name:
                return t.action
        return "keep"

    def device_actions(self) -> tuple[tuple[TensorAction, ...], ...]:
        """Every device's tensors, device 0 first (`devices` entries)."""
        return self.device_tensors or (self.tensors,) * self.devices

    def to_json(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("simulation", "capture")}
        if not self.search:
            del data["search"]
        if not self.compiled:
            del data["compiled"]
        data["overhead"] = self.overhead
        data["tensors"] = _tensors_json(self.tensors)
        data["device_tensors"] = [_tensors_json(ts) for ts in self.device_actions()]
        data["conv_workspace"] = [
            {"layer": c.layer, "kind": c.kind, "bytes": c.bytes, **({"torch_own": True} if c.torch_own else {})}
            for c in self.conv_workspace
        ]
        return data

    @classmethod
    def from_json(cls, data: dict) -> MemoryPlan:
        try:
            values = {k: v for k, v in data.items() if k not in ("overhead", "simulation", "capture")}
            values["tensors"] = tuple(TensorAction(**t) for t in data["tensors"])
            # absent in plans written before it existed
            values["device_tensors"] = tuple(
                tuple(TensorAction(**t) for t in ts) for ts in data.get("device_tensors", ())
            )
            values["conv_workspace"] = tuple(ConvWorkspace(**c) for c in data["conv_workspace"])
            return cls(**values)
        except (KeyError, TypeError, AttributeError) as exc:
            raise InvalidInput(f"not a memory plan: {exc}") from None
