"""Recomputing checkpoint segments: which fx nodes a plan's ``recompute`` storages make into segments, and
how the executor (`ucudnn.torch.memory`) runs one under `torch.utils.checkpoint`.

**Recompute.** A storage planned ``recompute`` makes a segment of the nodes from its producer to its
last forward reader; overlapping segments merge; each segment runs under non-reentrant
`torch.utils.checkpoint.checkpoint`, which keeps only the segment's inputs (kept or offloaded as the
plan says) and reruns the segment when its backward needs what it saved. A tensor planned ``keep``
whose every use lies inside such a segment is recomputed too (a checkpoint keeps only its inputs).
While recomputing, batch-norm layers normalise with the batch statistics without updating their
running statistics a second time, so the buffers equal those of plain training.
"""

from __future__ import annotations

from typing import Any

from torch.utils.checkpoint import checkpoint

from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.plan import MemoryPlan


def _segments(graph: TrainingGraph, plan: MemoryPlan, index: dict[str, int]) -> list[tuple[int, int]]:
    """Node ranges [first, last] (fx node indices) to run as checkpoint segments."""
    ranges = []
    for t in plan.tensors:
        if t.action != "recompute":
            continue
        producers = [op.name for op in graph.producers(t.name)]
        readers = [op.name for op in graph.ops
                   if op.type != "loss" and any(graph.storage_of(i) == t.name for i in op.inputs)]
        nodes = [index[n] for n in producers + readers if n in index]
        if producers and graph.op(producers[0]).type != "input" and nodes:
            ranges.append((min(nodes), max(nodes)))
    merged: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


class _RecomputeSegments:
    """The executor's checkpoint segments. A base of `ucudnn.torch.memory._Executor`, whose state and
    node runner it uses: `prep`, `stats`, `current`, `_run_node` and `_tag`."""

    def _run_segment(self, first: int, last: int, env: dict) -> None:
        inside = self.prep.nodes[first:last + 1]
        members = set(inside)
        inputs = list(dict.fromkeys(a for n in inside for a in n.all_input_nodes if a not in members))
        outputs = [n for n in inside if any(u not in members for u in n.users)]
        calls = [0]

        def run(*values: Any) -> tuple:
            local = dict(zip(inputs, values))
            recomputing = calls[0] > 0
            calls[0] += 1
            for i, node in enumerate(inside, first):
                local[node] = self._run_node(node, local, recomputing)
                for dead in self.prep.last_use.get(i, ()):  # free as the main loop does: the segment may be long
                    local.pop(dead, None)
            return tuple(local[n] for n in outputs)

        self.current = last  # the segment's inputs are needed when its last node's backward recomputes it
        results = checkpoint(run, *(env[a] for a in inputs), use_reentrant=False)
        self.stats.segments += 1
        for node, value in zip(outputs, results):
            env[node] = value
            self._tag(node, value, self.prep.index[node.name])
