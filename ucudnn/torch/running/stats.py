"""What a plan's run did (`ExecutionStats`), counted by the executor (`ucudnn.torch.running.executor`) and its
offloads and recomputation (`offload`, `recompute`): a module of its own, which all three import."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ExecutionStats"]


@dataclass
class ExecutionStats:
    """What `execute_plan` did, summed over the forward and backward passes run in its block.
    `recomputed` counts the storages rebuilt in backward passes.

    `events` is the order of copies and uses: ``("offload", name)``, ``("prefetch", name)`` and
    ``("unpack", name)``.

    What the executor's Python cost: `hook_calls` counts every call of its hooks (each tensor autograd
    saves or unpacks in the model's forward and backward passes, the model's forward hooks, the module hooks
    where a recomputed map is made, the backward pass's first prefetch), `acting_calls` those that did
    something (offload, drop, fetch, rebuild, follow a module call), `followed_ops` the operations the
    dispatch mode saw inside the module calls it followed.
    """

    offloaded: int = 0
    bytes_offloaded: int = 0
    prefetched: int = 0
    late_prefetches: int = 0
    recomputed: int = 0
    host_buffers_allocated: int = 0
    kept_released: set[str] = field(default_factory=set)
    events: list[tuple[str, str]] = field(default_factory=list)
    hook_calls: int = 0
    acting_calls: int = 0
    followed_ops: int = 0
