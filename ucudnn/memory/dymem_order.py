"""Dymem's graph analysis for fork/join networks (Yang & Cheng 2020, 3.1-3.3), on plain graphs.

Two pieces, each a function of operation names, their successors and their kinds:

- `dfs_order` (Algorithm 1): the execution order. At a fork, each branch is followed depth-first
  until it reaches the join; the join runs once its last branch arrives. A branch's short-lived
  maps are then freed one after another instead of all branches' maps living at once.
- `prefetch_starts` (Algorithm 2): in the backward pass, at each step Dymem starts the prefetch of
  the offloaded maps that the coming steps need, looking ahead until it has passed at most two
  convolutions (prefetching conv inputs earlier wastes memory; other layers are cheap, so their
  maps must already be in flight).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ucudnn.errors import InvalidInput

__all__ = ["CONV_LOOKAHEAD", "RECLAIMED_KINDS", "dfs_order", "prefetch_starts"]

# Algorithm 3, line 2: FC, Softmax and Dropout outputs are small and live long (the GTBM trace
# in `ucudnn.memory.dymem` classifies the rest by lifetime).
RECLAIMED_KINDS = frozenset({"linear", "fc", "softmax", "loss", "dropout"})
# Algorithm 2, line 7: "no more than two Convolution layers" prefetched ahead.
CONV_LOOKAHEAD = 2


def dfs_order(successors: Mapping[str, Sequence[str]]) -> list[str]:
    """Algorithm 1: a topological order that explores each branch of a fork depth-first to its join.

    `successors[op]` lists the operations that read op's output, in the order their branches are
    explored. An operation with several predecessors is emitted when its last predecessor is.
    """
    indegree = {op: 0 for op in successors}
    for op, nexts in successors.items():
        for nxt in nexts:
            if nxt not in indegree:
                raise InvalidInput(f"successors[{op!r}] names {nxt!r}, which is not an operation of the graph")
            indegree[nxt] += 1
    order: list[str] = []
    # An explicit stack instead of recursion: ResNet-152 is deeper than Python's recursion limit.
    stack = [op for op in reversed(list(successors)) if indegree[op] == 0]
    remaining = dict(indegree)
    while stack:
        op = stack.pop()
        order.append(op)
        ready = []
        for nxt in successors[op]:
            remaining[nxt] -= 1
            if remaining[nxt] == 0:
                ready.append(nxt)
        stack.extend(reversed(ready))  # the first branch is explored first
    if len(order) != len(successors):
        cyclic = sorted(op for op in successors if remaining[op] > 0)
        raise InvalidInput(f"the graph has a cycle through {', '.join(cyclic[:5])}")
    return order


def prefetch_starts(
    steps: Sequence[tuple[str, Sequence[str]]], offloaded: set[str], *, conv_lookahead: int = CONV_LOOKAHEAD
) -> dict[str, int]:
    """Algorithm 2: for each offloaded tensor, the backward step at whose start its prefetch begins.

    `steps` is the backward pass in execution order, each step as (kind, tensors it reads). At
    step k Dymem prefetches what steps k+1.. read, up to and including the `conv_lookahead`-th
    convolution after k. A tensor read at step 0 is prefetched before the backward pass (-1).
    """
    if conv_lookahead < 1:
        raise InvalidInput(f"conv_lookahead must be at least 1, got {conv_lookahead!r}")
    n = len(steps)
    conv_steps = [k for k, (kind, _) in enumerate(steps) if kind == "conv"]

    def window_end(k: int) -> int:  # the last step that step k's look-ahead reaches
        later = [c for c in conv_steps if c > k]
        return later[conv_lookahead - 1] if len(later) >= conv_lookahead else n - 1

    ends = [window_end(k) for k in range(-1, n)]  # ends[k + 1] for k = -1..n-1, non-decreasing
    starts: dict[str, int] = {}
    for use, (_, reads) in enumerate(steps):
        for t in reads:
            if t in offloaded and t not in starts:
                starts[t] = next(k for k in range(-1, use) if ends[k + 1] >= use)
    return starts
