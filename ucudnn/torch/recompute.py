"""Recomputing the storages a plan drops: what the executor (`ucudnn.torch.memory`) saves in their place
in the forward pass, and how it rebuilds them in the backward pass, as the simulator schedules it
(`ucudnn.memory.simulate.expand`).

**Dropped.** A tensor that autograd saves and that lives in a storage planned ``recompute`` is saved
as a `_Dropped` handle: the storage's name and the tensor's place in it (size, stride, offset), no
data. The storage's memory goes when the forward pass no longer reads it, as a released one does.

**Rebuilt.** The first backward step that unpacks such a handle runs the storage's producing fx nodes
again (its owner, then its in-place writers and views, in forward order), without recording a graph,
from the values those nodes read outside the storage. The forward pass saved those *sources* when each
producer ran, through the same hooks as autograd's saves: a kept source is held, an offloaded one
is copied out and prefetched back, a dropped one is itself rebuilt first (which is how a chain of
recomputed maps comes back). A rebuilt storage stays until the last handle saved for it is unpacked,
so each storage is rebuilt once per step and each producer runs once more at most: what the
simulator charges. (`torch.utils.checkpoint` was the executor's tool before: a checkpoint segment
must hold every reader of what it drops, since a reader outside would save its input, so it ran
those readers again too, which no plan counted.)

**Faithful.** Batch-norm layers normalise with the batch's statistics and leave their running
statistics as the forward pass left them. Each producer runs with the random-number state it ran
with in the forward pass (a dropout draws the same mask). A source modified in place after a
producer read it is refused: the rebuilt storage would differ.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from ucudnn.errors import UnsupportedProblem
from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.plan import MemoryPlan


@dataclass(frozen=True)
class _Program:
    """How to rebuild one storage: its producing fx nodes in forward order, and the index of the last
    forward node that reads it (backward needs it from that node's step on: its sources' `use`)."""

    storage: str
    nodes: tuple[fx.Node, ...]
    late: int


class _Programs:
    """The programs of a plan for one input shape: by storage, and by fx node (those it is a producer in)."""

    def __init__(self, programs: dict[str, _Program]) -> None:
        self.by_storage = programs
        self.by_node: dict[fx.Node, list[_Program]] = {}
        for program in programs.values():
            for node in program.nodes:
                self.by_node.setdefault(node, []).append(program)


def _programs(graph: TrainingGraph, plan: MemoryPlan, nodes: Iterable[fx.Node]) -> _Programs:
    """A program for every storage the plan recomputes, but the inputs (kept), and for every released
    storage that one of those programs reads (the simulator rebuilds those too)."""
    by_name = {n.name: n for n in nodes}
    index = {n: i for i, n in enumerate(by_name.values())}
    actions = {t.name: t.action for t in plan.tensors}
    out: dict[str, _Program] = {}
    pending = [s for s, a in actions.items() if a == "recompute"]
    while pending:
        storage = pending.pop()
        if storage in out:
            continue
        producers = tuple(by_name[op.name] for op in graph.producers(storage) if op.name in by_name)
        if not producers or producers[0].op == "placeholder":
            continue  # an input: nothing rebuilds it, so it is kept
        readers = [index[by_name[op.name]] for op in graph.ops if op.name in by_name
                   and any(graph.storage_of(i) == storage for i in op.inputs)]
        out[storage] = _Program(storage, producers, max(readers, default=index[producers[-1]]))
        for node in producers:
            for source in node.all_input_nodes:
                src = _storage_of(graph, source)
                if src is not None and src != storage and actions.get(src) == "release":
                    pending.append(src)
    return _Programs(out)


def _storage_of(graph: TrainingGraph, node: fx.Node) -> str | None:
    """The storage `node`'s value lives in (None: not a feature map, such as a size)."""
    return graph.storage_of(node.name) if node.name in graph.op_index else None


class _Dropped:
    """What a saved tensor of a dropped storage leaves behind: where it lies in the storage. Until its
    node has returned, a tensor saved by a node for its own output (or internals such as max-pool
    indices) is held in `tensor`; `_after_node` then drops it if it is the output."""

    __slots__ = ("rebuilds", "name", "size", "stride", "offset", "tensor")

    def __init__(self, rebuilds: _Rebuilds, name: str, t: torch.Tensor, held: bool) -> None:
        self.rebuilds, self.name = rebuilds, name
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.tensor = t.detach() if held else None


class _Rebuilds:
    """One forward pass's dropped storages: the sources saved for their programs, the random-number
    states their producers ran with, and, in the backward pass, the rebuilt storages in use."""

    def __init__(self, programs: _Programs) -> None:
        self.programs = programs
        self.sources: dict[tuple[str, fx.Node], tuple[Any, int | None]] = {}  # (storage, node) -> saved, version
        self.rng: dict[fx.Node, tuple] = {}
        self.unresolved: list[_Dropped] = []
        self.handles: dict[str, int] = {}  # storage -> handles not yet unpacked
        self.rebuilt: dict[str, torch.Tensor] = {}


class _Recompute:
    """The executor's recomputation. A base of `ucudnn.torch.memory._Executor`, whose state and hooks
    it uses: `prep`, `stats`, `current`, `pack`, `unpack`, `_run_node` and `_name_of`; `rebuilds` is the
    forward pass's (a handle keeps its own: two forward passes may precede their backward passes)."""

    rebuilds: _Rebuilds

    # -- the forward pass ---------------------------------------------------------------------------
    def _drop(self, name: str, t: torch.Tensor, tagged: bool) -> _Dropped:
        """The handle saved in place of `t`, in dropped storage `name`."""
        r = self.rebuilds
        dropped = _Dropped(r, name, t, held=not tagged)
        if tagged:
            r.handles[name] = r.handles.get(name, 0) + 1
        else:
            r.unresolved.append(dropped)
        return dropped

    def _before_node(self, node: fx.Node) -> None:
        if node in self.rebuilds.programs.by_node:
            self.rebuilds.rng[node] = _rng_state()

    def _after_node(self, node: fx.Node, env: dict) -> None:
        """`node` has run and its output is tagged: settle what it saved, and save the sources of the
        programs it is a producer in."""
        r = self.rebuilds
        output = _data_ptr(env.get(node))
        for dropped in r.unresolved:
            if dropped.tensor.untyped_storage().data_ptr() == output:
                dropped.tensor = None  # the node's own output: rebuilt in the backward pass
                r.handles[dropped.name] = r.handles.get(dropped.name, 0) + 1
        r.unresolved.clear()
        current = self.current
        try:
            for program in r.programs.by_node.get(node, ()):
                self.current = program.late  # an offloaded source is used when backward rebuilds
                for source in node.all_input_nodes:
                    key = (program.storage, source)
                    if key not in r.sources and source not in program.nodes:
                        value = env[source]
                        version = value._version if isinstance(value, torch.Tensor) else None
                        r.sources[key] = fx.node.map_aggregate(value, self._save_source), version
        finally:
            self.current = current

    def _save_source(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        name, tagged = self._name_of(value)
        if tagged and name in self.rebuilds.programs.by_storage:  # recomputed, or released and rebuilt
            return self._drop(name, value, tagged=True)
        return self.pack(value)

    # -- the backward pass --------------------------------------------------------------------------
    def _unpack_dropped(self, dropped: _Dropped) -> torch.Tensor:
        if dropped.tensor is not None:
            return dropped.tensor
        r = dropped.rebuilds
        base = r.rebuilt.get(dropped.name)
        if base is None:
            base = r.rebuilt[dropped.name] = self._rebuild(r, r.programs.by_storage[dropped.name])
        r.handles[dropped.name] -= 1
        if r.handles[dropped.name] <= 0:  # its last handle: whoever unpacked it holds it now
            del r.rebuilt[dropped.name]
        return base.as_strided(dropped.size, dropped.stride, dropped.offset)

    def _rebuild(self, r: _Rebuilds, program: _Program) -> torch.Tensor:
        local: dict[fx.Node, Any] = {}
        for node in program.nodes:
            for source in node.all_input_nodes:
                if source in local or source in program.nodes:
                    continue
                if (program.storage, source) not in r.sources:  # popped by the first rebuild
                    raise UnsupportedProblem(
                        f"{program.storage!r} was already recomputed for a backward pass; under execute_plan run "
                        "backward once per forward (no retain_graph=True for a second backward through "
                        "recomputed tensors)")
                saved, version = r.sources.pop((program.storage, source))
                value = fx.node.map_aggregate(saved, self.unpack)
                if version is not None and isinstance(saved, torch.Tensor) and value._version != version:
                    raise UnsupportedProblem(
                        f"{source.name} was modified in place after {node.name} read it in the forward pass, so "
                        f"{program.storage!r} cannot be recomputed from it; keep {program.storage!r} in the plan")
                local[source] = value
            before = _rng_state()
            _set_rng(r.rng[node])
            try:
                with torch.no_grad():
                    local[node] = self._run_node(node, local, recomputing=True)
            finally:
                _set_rng(before)
        self.stats.recomputed += 1
        return local[program.nodes[-1]]


def _data_ptr(value: Any) -> int | None:
    return value.untyped_storage().data_ptr() if isinstance(value, torch.Tensor) else None


def _rng_state() -> tuple:
    """The random-number generators' states: the CPU's and, where CUDA is in use, every device's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])
