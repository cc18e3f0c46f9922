"""Recomputing the storages a plan drops: what the executor (`ucudnn.torch.running.executor`) saves in their place in
the forward pass, and how it rebuilds them in the backward pass, as the simulator schedules it
(`ucudnn.memory.simulate.expand`).

**Dropped.** A tensor that autograd saves and that lives in a storage planned ``recompute`` is saved
as a `_Dropped` handle: the storage's name and the tensor's place in it (size, stride, offset), no
data. The storage's memory goes when the forward pass
no longer reads it, as a released one does.

**Rebuilt.** The first backward step that unpacks such a handle runs again, without recording a graph,
the captured operations that made the storage and then wrote it in place (`CapturedStep.writers`),
each with the arguments it ran with: the storage itself where it read it (a view of the rebuilt
one), parameters as they are, other tensors (buffers, constants) as copies (a batch-norm's running
statistics move once per step), and the feature maps it read from elsewhere, its *sources*, which
the forward pass saved when the operation ran, through the same hooks as autograd's saves: a kept
source is held, an offloaded one copied out and prefetched back, a dropped one is itself rebuilt
first (which is how a chain of recomputed maps comes back). A rebuilt storage stays until the last
handle saved for it is unpacked (a save no backward step unpacks, as the capture saw it, counts none),
so each storage is rebuilt once per step and each operation runs once more at most: what the simulator
charges.

**Faithful.** An operation that draws random numbers runs with the random-number state it ran with in
the forward pass (a dropout draws the same mask). A source or a tensor argument changed in place
after the operation read it is refused: the rebuilt storage would differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils._pytree import tree_leaves

from ucudnn.errors import UnsupportedProblem

if TYPE_CHECKING:
    from ucudnn.torch.capturing.graph import CapturedStep
    from ucudnn.torch.running.offload import _Offloaded, _Pass
    from ucudnn.torch.running.stats import ExecutionStats

__all__ = ["Program", "programs_for"]


@dataclass(frozen=True, slots=True)
class Program:
    """How to rebuild one storage: the captured operations that made it and wrote it, in order, and which
    output of the first it is."""

    storage: str
    ops: tuple[int, ...]
    leaf: int


def programs_for(step: Any, actions: dict[str, str]) -> dict[str, Program]:
    """A program for every storage the plan recomputes (made in the model's forward pass; an input is
    kept), and for every released storage that one of those programs reads (the simulator rebuilds those
    too). Sources are known only when the operations run, so a released source is found by its name in
    the graph: the feature maps an op of a program reads."""
    graph = step.graph
    out: dict[str, Program] = {}
    pending = [s for s, a in actions.items() if a == "recompute"]
    while pending:
        storage = pending.pop()
        ops = step.writers.get(storage)
        if storage in out or not ops or ops[0] >= step.model_ops:
            continue
        leaf = next(leaf for leaf, name in step.ops[ops[0]].creates if name == storage)
        out[storage] = Program(storage, tuple(i for i in ops if i < step.model_ops), leaf)
        for op in graph.producers(storage):
            for source in op.inputs:
                src = graph.storage_of(source)
                if src != storage and actions.get(src) == "release":
                    pending.append(src)
    return out


class _Dropped:
    """What a saved tensor of a dropped storage leaves behind: where in the storage it lies, and the op whose
    backward step unpacks it (None: a source saved for a rebuild)."""

    __slots__ = ("at", "name", "offset", "rebuilds", "size", "stride")

    def __init__(self, rebuilds: _Rebuilds, name: str, t: torch.Tensor, at: int | None = None) -> None:
        self.rebuilds, self.name, self.at = rebuilds, name, at
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


@dataclass(frozen=True, slots=True)
class _View:
    """An argument that was (a view of) a storage the operation is a producer of (the one being rebuilt)."""

    storage: str
    size: tuple
    stride: tuple
    offset: int | torch.SymInt  # (an int, as the step runs eagerly)


class _Source:
    """A feature map an operation read from elsewhere: saved as autograd's saves are."""

    __slots__ = ("saved", "version")

    def __init__(self, saved: Any, version: int | None) -> None:
        self.saved, self.version = saved, version


class _Other:
    """Another tensor argument: a parameter (passed as it is) or a buffer or constant (copied)."""

    __slots__ = ("parameter", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, parameter: bool) -> None:
        self.tensor, self.parameter, self.version = tensor, parameter, tensor._version


class _Rebuilds:
    """One forward pass's dropped storages: each program operation's recorded call, and, in the backward
    pass, the rebuilt storages in use."""

    def __init__(self, programs: dict[str, Program], pass_: Any = None) -> None:
        self.programs = programs
        self.pass_ = pass_  # the forward pass's offloads (`ucudnn.torch.running.offload._Pass`)
        self.made: dict[str, int] = {}  # storage -> the key of the storage its producer made in this pass
        # op -> [func, (args, kwargs), rng, programs yet to replay it]: an op making several dropped storages
        # (a batch-norm's output and statistics) is in several programs, and its sources go after the last
        self.calls: dict[int, list] = {}
        self.handles: dict[str, int] = {}  # storage -> handles not yet unpacked
        self.rebuilt: dict[str, torch.Tensor] = {}
        self.done: set[str] = set()  # storages rebuilt in this backward pass


class _Sources(Protocol):
    """What recomputation asks of the executor's prepared plan (`ucudnn.torch.running.prepared_plan._Prepared`,
    whose module imports this one): the storages of the model's parameters, and each map's action."""

    @property
    def params(self) -> AbstractSet[int]: ...

    @property
    def actions(self) -> Mapping[str, str]: ...


class _Recompute:
    """The executor's recomputation. A base of `ucudnn.torch.running.executor._Executor`, whose state and hooks
    it uses (as annotated here); `rebuilds` is the forward pass's (a handle keeps its own: two forward passes may
    precede their backward passes)."""

    prep: _Sources
    step: CapturedStep | None
    stats: ExecutionStats
    rebuilds: _Rebuilds

    if TYPE_CHECKING:  # the executor's saved-tensor hook, and its offloads' (`_OffloadHooks`)

        def unpack(self, saved: Any) -> torch.Tensor: ...

        def reached(self, p: _Pass, i: int) -> None: ...

        def _offload(self, name: str, t: torch.Tensor, uses: int = 1) -> _Offloaded: ...

    # -- the forward pass ---------------------------------------------------------------------------
    def _drop(self, name: str, t: torch.Tensor, uses: int = 1, at: int | None = None) -> _Dropped:
        """The handle saved in place of `t`, in dropped storage `name`, to be unpacked `uses` times (by the
        backward step of op `at`)."""
        r = self.rebuilds
        r.handles[name] = r.handles.get(name, 0) + uses
        return _Dropped(r, name, t, at)

    def _record(
        self, storages: tuple[str, ...], index: int, func: Any, args: tuple, kwargs: dict, random: bool
    ) -> list[_Other]:
        """Keep what operation `index`, a producer of `storages`' programs, reads (see the module docstring);
        the non-feature-map arguments, whose versions are taken once the operation has run. Which argument
        is which feature map, the capture says (`CapturedOp.args`)."""
        others: list[_Other] = []
        assert self.step is not None  # (recorded while the step runs)
        roles = iter(self.step.ops[index].args)

        def keep(a: Any) -> Any:
            if not isinstance(a, torch.Tensor):
                return a
            name = next(roles, None)
            if name in storages:
                return _View(name, tuple(a.size()), tuple(a.stride()), a.storage_offset())
            if name is not None:
                return _Source(self._save_source(name, a, len(storages)), a._version)
            others.append(_Other(a, a.untyped_storage()._cdata in self.prep.params))
            return others[-1]

        rng = _rng_state() if random else None
        self.rebuilds.calls[index] = [func, _map_args(keep, args, kwargs), rng, len(storages)]
        return others

    def _save_source(self, name: str, t: torch.Tensor, uses: int) -> Any:
        """`t` saved for `uses` replays of the operation reading it (one per program it is in)."""
        if name in self.rebuilds.programs:  # recomputed, or released and rebuilt
            return self._drop(name, t, uses)
        if self.prep.actions.get(name) == "offload":
            return self._offload(name, t, uses)
        return t  # held: detached by `_settle_sources`

    def _settle_sources(self) -> None:
        """At the forward pass's end, outside the dispatcher: the tensors held for rebuilding are detached
        (their autograd history would tie the executor's records to the graph). Detached inside a dispatch
        mode, below autograd, a tensor would not share its version counter, which the checks read."""
        for _, (args, kwargs), _, _ in self.rebuilds.calls.values():
            for a in _args(args, kwargs):
                if isinstance(a, _Source) and isinstance(a.saved, torch.Tensor):
                    a.saved = a.saved.detach()
                elif isinstance(a, _Other):
                    a.tensor = a.tensor.detach()

    # -- the backward pass --------------------------------------------------------------------------
    def _unpack_dropped(self, dropped: _Dropped) -> torch.Tensor:
        r = dropped.rebuilds
        if dropped.at is not None and r.pass_ is not None and r.pass_.entries:
            self.reached(r.pass_, dropped.at)  # the backward step of op `at` runs: prefetch for it and ahead
        base = r.rebuilt.get(dropped.name)
        if base is None:
            base = r.rebuilt[dropped.name] = self._rebuild(r, r.programs[dropped.name])
        r.handles[dropped.name] -= 1
        if r.handles[dropped.name] <= 0:  # its last handle: whoever unpacked it holds it now
            del r.rebuilt[dropped.name]
        return base.as_strided(dropped.size, dropped.stride, dropped.offset)

    def _rebuild(self, r: _Rebuilds, program: Program) -> torch.Tensor:
        base: torch.Tensor | None = None

        def value(a: Any) -> Any:
            if isinstance(a, _View):
                assert base is not None  # the program's first operation made the storage its views read
                return base.as_strided(a.size, a.stride, a.offset)
            if isinstance(a, _Source):
                got = self.unpack(a.saved)
                if isinstance(a.saved, torch.Tensor) and got._version != a.version:
                    raise UnsupportedProblem(
                        f"a tensor {program.storage!r} is made from was modified in place after "
                        f"it was read in the forward pass, so {program.storage!r} cannot be "
                        f"recomputed; keep {program.storage!r} in the plan"
                    )
                return got
            if isinstance(a, _Other):
                if a.tensor._version != a.version:
                    raise UnsupportedProblem(
                        f"a parameter or buffer {program.storage!r} is made from changed after "
                        f"the forward pass; keep {program.storage!r} in the plan"
                    )
                return a.tensor if a.parameter else a.tensor.clone()  # a buffer it updates moves once per step
            return a

        if program.storage in r.done:
            raise UnsupportedProblem(
                f"{program.storage!r} was already recomputed for a backward pass; under execute_plan run backward "
                "once per forward (no retain_graph=True for a second backward through recomputed tensors)"
            )
        r.done.add(program.storage)
        for index in program.ops:
            call = r.calls[index]
            func, recorded, rng = call[:3]
            call[3] -= 1
            if call[3] == 0:  # its last program: what it holds goes
                del r.calls[index]
            args, kwargs = _map_args(value, *recorded)
            before = _rng_state() if rng is not None else None
            try:
                if rng is not None:
                    _set_rng(rng)
                with torch.no_grad():
                    out = func(*args, **kwargs)
            finally:
                if before is not None:
                    _set_rng(before)
            if base is None:  # the owner
                base = tree_leaves(out)[program.leaf]
        assert base is not None  # (a program replays at least its owner)
        self.stats.recomputed += 1
        return base


def _map_args(fn: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`fn` on each argument of an ATen call and on each element of a list argument, in `tree_leaves`' order
    (which the capture named them in): an operator's arguments nest one list deep at most (``Tensor[]``), so
    a replay's hot path walks no pytree."""

    def one(a: Any) -> Any:
        return type(a)(map(fn, a)) if type(a) in (list, tuple) else fn(a)

    return tuple(map(one, args)), {k: one(v) for k, v in kwargs.items()}


def _args(args: tuple, kwargs: dict) -> list:
    """The arguments of an ATen call, list elements in place of their lists (as `_map_args` sees them)."""
    out: list = []
    _map_args(out.append, args, kwargs)
    return out


def _rng_state() -> tuple:
    """The random-number generators' states: the CPU's and, where CUDA is in use, every device's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])
