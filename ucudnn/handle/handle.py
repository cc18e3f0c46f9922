"""`Handle`: what a framework holds instead of a cuDNN handle.

A `Handle` runs the three convolution kernels (`conv_forward`, `conv_backward_data`,
`conv_backward_filter`) on NumPy arrays (CuPy on a GPU). The first time it sees a kernel it
measures the candidate algorithms at the micro-batch sizes of its policy (through the
measurement cache), solves for the fastest configuration within its workspace budget, stores the
plan in the cache, and from then on runs that plan.

Two budgets, as in the paper:

- **WR** (``workspace_limit=M``, or no limit at all): each kernel independently gets the fastest
  configuration whose workspace is at most ``M`` (`wr.solve`). Kernels run one after another, so
  they reuse *one* workspace buffer: it is allocated for the first kernel and grown (never shrunk)
  when a later kernel needs more. ``peak_workspace`` is its size, at most ``M``.
- **WD** (``total_workspace=W``): one arena of ``W`` bytes (a single `empty_workspace` buffer) is
  divided among all kernels of the network: each kernel owns a segment (a slice of the arena)
  whose size the network-wide program `wd.solve` chose over each kernel's Pareto front. The
  framework first *announces* its layers with `register` (``ucudnn.torch.announce`` does it
  with one recording forward pass); the first real convolution then solves the whole network at
  once. A layer that is first seen after that solve (or one whose shape changed) is registered
  on the fly, with a `LateRegistrationWarning`, and the next convolution re-solves the network.
  ``peak_workspace`` is the number of arena bytes assigned to segments, at most ``W``.

Plans are keyed per mini-batch size: the last, smaller batch of an epoch gets its own plan (in
WD, a plan of the same registered layers at that batch). Layers with the same shape share their
measurements and (in WR) their plans, in memory and in the database.

`prepare(kind, x_shape, w_shape, ...)` plans a kernel without running it and returns its
configuration (like cudnnGet*Algorithm); `choices()` lists every planned kernel with its
configuration, baseline and (WD) segment; `stats` says how much benchmarking it took.

A Handle is not thread-safe (neither is a cuDNN handle): give each thread its own.

This module is the Handle's surface, tying together the package's parts (its mixins and helpers); its kernel
calls (`conv_forward` ... `kernel`) are `ucudnn.handle.calls`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Self

from ucudnn.backends import get_backend
from ucudnn.backends.base import Backend
from ucudnn.backends.cpu import NATIVE
from ucudnn.errors import InvalidInput
from ucudnn.handle.arena import _Workspaces
from ucudnn.handle.calls import _Calls
from ucudnn.handle.kernel import _Launching, _Prepared, _prepared
from ucudnn.handle.planning import _Plan, _Planning
from ucudnn.handle.replan import _Recovery
from ucudnn.handle.trials import _Trials
from ucudnn.kernel.call_overhead import charged_fronts
from ucudnn.kernel.measure import DEFAULT_BENCHMARK_LIMIT, BenchStats, Policy, parse_policy, policy_name
from ucudnn.problem import KINDS, ConvProblem
from ucudnn.sizes import parse_size
from ucudnn.solver import pareto
from ucudnn.solver.types import Configuration, Infeasible, MicroConfig


class LateRegistrationWarning(UserWarning):
    """A WD layer was announced after the network was solved; the network is solved again."""


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """One planned kernel: what runs for `layer`'s `kind` kernel at mini-batch `batch`.

    `baseline` is plain cuDNN-style selection (the fastest algorithm at the whole batch within the
    same limit: ``M`` in WR, an equal share ``W / K`` in WD), or None when nothing fits undivided.
    `offset` is the byte offset of the kernel's segment in the WD arena (None in WR); the segment
    is ``arena[offset : offset + config.workspace]``.
    """

    layer: str
    kind: str
    batch: int
    problem: ConvProblem
    config: Configuration
    baseline: MicroConfig | None
    offset: int | None

    @property
    def micro_batched(self) -> bool:
        """Whether the plan runs the mini-batch as more than one micro-batch."""
        return len(self.config.micros) > 1


class Handle(_Calls, _Planning, _Trials, _Recovery, _Workspaces, _Launching):
    """Runs convolution kernels with micro-batched, workspace-bounded configurations.

    Parameters (all keyword-only)
    ----------
    backend : "auto" (cudnn when usable, else cpu), "cpu", "cudnn", or a `Backend` instance.
    policy : micro-batch sizes to measure: "powerOfTwo" (default), "all", "undivided", a string
        such as "1,4,16", or a tuple of sizes.
    workspace_limit : WR limit ``M`` per kernel, bytes or a size string ("64MiB"); None = no limit.
    total_workspace : WD budget ``W`` for the whole network, bytes or a size string. Give at most
        one of the two limits.
    db : where measurements and plans persist: None for the default cache (``$UCUDNN_DB`` or the
        user cache folder), a SQLAlchemy URL or SQLite file path, ":memory:" / "sqlite://" for a
        database that lives as long as the handle, or False for no database at all.
    reps : timed runs per measurement (the median is kept).
    algos : restrict the candidate algorithms (default: every algorithm of the backend). On the
        cpu backend, `fft` spreads a non-finite input value over the whole sample (over every
        filter tap in bwd_filter) and `winograd` over its 2x2 output tiles; leave them out where
        NaN or Inf must stay where the convolution puts it.
    call_overhead : host time (ms) its caller pays per kernel call for every configuration other
        than `native` on the whole batch, which the caller runs itself (`ucudnn.kernel.call_overhead`).
        The plans charge it, so they pick a NumPy algorithm only where it wins by more.
        ``ucudnn.torch`` measures it once per process for the handles it makes on the CPU; 0 (the
        default) charges nothing.
    trial_runs : for callers that run kernels inside a larger step (``ucudnn.torch`` on the CPU):
        a kernel planned as anything but `native` on the whole batch alternates with native for
        its first ``2 * (trial_runs + 1)`` runs, timed where they run (the first of each untimed),
        and keeps native for good unless the plan's median beats native's by more than
        `call_overhead` (a kernel measured alone can win there and lose inside a step, where
        caches and thread pools are shared). 0 (the default): no trials.
    benchmark_limit : as PyTorch's ``torch.backends.cudnn.benchmark_limit``: at most this many
        candidates are timed per kernel and micro-batch size, the backend's best-ranked first, and a
        candidate that lost clearly at the next larger size is not timed at the smaller ones
        (`ucudnn.kernel.measure.measure_table`). 0 or None: every candidate at every size.
    """

    def __init__(
        self,
        *,
        backend: str | Backend = "auto",
        policy: Policy = "powerOfTwo",
        workspace_limit: int | str | None = None,
        total_workspace: int | str | None = None,
        db: str | bool | None = None,
        reps: int = 3,
        algos: Sequence[str] | None = None,
        call_overhead: float = 0.0,
        trial_runs: int = 0,
        benchmark_limit: int | None = DEFAULT_BENCHMARK_LIMIT,
    ) -> None:
        self._options: dict[str, Any] = {  # what `__reduce__` makes the handle again from
            "backend": backend,
            "policy": policy,
            "workspace_limit": workspace_limit,
            "total_workspace": total_workspace,
            "db": db,
            "reps": reps,
            "algos": tuple(algos) if algos is not None else None,
            "call_overhead": call_overhead,
            "trial_runs": trial_runs,
            "benchmark_limit": benchmark_limit,
        }
        if workspace_limit is not None and total_workspace is not None:
            raise InvalidInput("give workspace_limit (WR, per kernel) or total_workspace (WD, per network), not both")
        self._workspace_limit = None if workspace_limit is None else parse_size(workspace_limit)
        self._total_workspace = None if total_workspace is None else parse_size(total_workspace)
        if isinstance(policy, str):
            self._policy: Policy = parse_policy(policy)
        elif isinstance(policy, tuple) and policy and all(isinstance(s, int) and s >= 1 for s in policy):
            self._policy = tuple(sorted(set(policy)))
        else:
            raise InvalidInput(f"policy must be a policy name or a tuple of positive sizes, got {policy!r}")
        if not isinstance(reps, int) or isinstance(reps, bool) or reps < 1:
            raise InvalidInput(f"reps must be a positive integer, got {reps!r}")
        self._reps = reps
        if (
            isinstance(call_overhead, bool)
            or not isinstance(call_overhead, (int, float))
            or not math.isfinite(call_overhead)
            or call_overhead < 0
        ):
            raise InvalidInput(f"call_overhead must be a finite number of milliseconds >= 0, got {call_overhead!r}")
        self._call_overhead = float(call_overhead)
        if isinstance(trial_runs, bool) or not isinstance(trial_runs, int) or trial_runs < 0:
            raise InvalidInput(f"trial_runs must be a non-negative integer, got {trial_runs!r}")
        self._trial_runs = trial_runs
        # (problem key, batch, configuration) that won its in-step trial
        self._trials_kept: set[tuple[str, int, Configuration]] = set()
        if benchmark_limit is not None and (
            isinstance(benchmark_limit, bool) or not isinstance(benchmark_limit, int) or benchmark_limit < 0
        ):
            raise InvalidInput(f"benchmark_limit must be a non-negative integer or None, got {benchmark_limit!r}")
        self._benchmark_limit = benchmark_limit or 0
        if db is True or not (db is None or db is False or isinstance(db, str) or hasattr(db, "__fspath__")):
            raise InvalidInput(f"db must be None (default cache), a URL or path, ':memory:', or False; got {db!r}")
        self._db = db
        if isinstance(backend, str):
            self._backend = get_backend(backend)
        elif isinstance(backend, Backend):
            self._backend = backend
        else:
            raise InvalidInput(f"backend must be a backend name or a Backend instance, got {backend!r}")
        self._algos = self._options["algos"]
        if self._algos is not None and not self._algos:
            raise InvalidInput("algos must name at least one algorithm (or be None for all)")

        self._cache: Any = None  # opened on first use
        self._cache_open = False
        self._stats = BenchStats()
        # call signature -> what to run; WD re-solves clear it
        self._prepared: dict[tuple, _Prepared] = {}
        self._generation = 0  # bumped whenever _prepared is dropped: Kernel objects made before are stale
        # WR: (problem.key, batch, limit) -> plan; one workspace buffer shared by every kernel
        self._wr_plans: dict[tuple[str, int, int | None], _Plan] = {}
        self._wr_seen: dict[tuple[str, str, int], ConvProblem] = {}
        self._buffer: Any = None
        self._slices: tuple[Any, dict] = (None, {})  # the buffer or arena last sliced, and its run slices
        self._buffer_bytes = 0
        # called around every kernel run, with (+bytes, the array it writes, the arrays it reads) before and
        # (-bytes, None) after,
        # the bytes of a workspace held for that run only (a plan's budget), else 0; set by
        # `ucudnn.torch.checking.tracker.StepTracker` while it counts
        self.workspace_listener: Any = None
        # WD: layer -> (fwd problem at any batch, kinds); batch -> (layer, kind) -> plan; one arena
        self._layers: dict[str, tuple[ConvProblem, frozenset[str]]] = {}
        self._wd_plans: dict[int, dict[tuple[str, str], tuple[ConvProblem, _Plan]]] = {}
        self._wd_solved = False
        self._arena: Any = None
        self._peak_bytes = 0
        # Recovery from planned algorithms that cannot run (see _run): failures recorded this
        # session ((problem key, algo, batch) -> unusable MicroConfig), and whether the one warning
        # was given.
        self._failed: dict[tuple[str, str, int], MicroConfig] = {}
        self._warned_failure = False

    # ---- introspection ------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def mode(self) -> str:
        """ "WD" with a total workspace, else "WR"."""
        return "WD" if self._total_workspace is not None else "WR"

    @property
    def workspace_limit(self) -> int | None:
        return self._workspace_limit

    @property
    def total_workspace(self) -> int | None:
        return self._total_workspace

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def benchmark_limit(self) -> int:
        """Candidates timed per kernel and micro-batch size at most (0: all of them)."""
        return self._benchmark_limit

    @property
    def trial_runs(self) -> int:
        """Timed runs of each side of a kernel's in-step trial against native (0: no trials)."""
        return self._trial_runs

    @property
    def call_overhead(self) -> float:
        """Host time (ms) charged per kernel call to every plan but native undivided (0: none)."""
        return self._call_overhead

    @property
    def peak_workspace(self) -> int:
        """Most workspace bytes held at once: WR, the shared buffer; WD, the arena bytes in segments."""
        return self._peak_bytes

    @property
    def workspace_bytes(self) -> int:
        """Workspace bytes the handle holds now (its WR buffer and its WD arena), for memory accounting."""
        return (self._buffer_bytes if self._buffer is not None else 0) + (
            int(self._arena.nbytes) if self._arena is not None else 0
        )

    @property
    def arena(self) -> Any:
        """The WD arena (one buffer of `total_workspace` bytes, allocated at the first solve), else None (as
        on a backend whose kernels take their workspace per run: `Backend.workspace_per_run`)."""
        return self._arena

    @property
    def generation(self) -> int:
        """Changes whenever prepared kernels become stale (a WD re-solve); see `Kernel`."""
        return self._generation

    @property
    def wd_solved(self) -> bool:
        """WD: whether the workspace division has been solved (layers announced later re-solve it)."""
        return self._wd_solved

    @property
    def stats(self) -> BenchStats:
        """Benchmark work so far: micro-configs measured, taken from the cache, and seconds spent."""
        return self._stats

    @property
    def layers(self) -> dict[str, tuple[ConvProblem, frozenset[str]]]:
        """WD registry: layer -> (its forward problem, the kinds announced). A copy."""
        return dict(self._layers)

    def choices(self) -> list[KernelChoice]:
        """Every kernel planned so far (WR: those that ran; WD: every registered kernel per solved batch)."""
        out: list[KernelChoice] = []
        if self.mode == "WR":
            for (layer, kind, batch), problem in self._wr_seen.items():
                plan = self._wr_plans[problem.key, batch, self._workspace_limit]
                out.append(KernelChoice(layer, kind, batch, problem, plan.config, plan.baseline, None))
        else:
            for batch, plans in self._wd_plans.items():
                for (layer, kind), (problem, plan) in plans.items():
                    out.append(KernelChoice(layer, kind, batch, problem, plan.config, plan.baseline, plan.offset))
        return out

    def __repr__(self) -> str:
        limit = (
            f"workspace_limit={self._workspace_limit}"
            if self.mode == "WR"
            else f"total_workspace={self._total_workspace}"
        )
        return (
            f"Handle(backend={self._backend.name!r}, mode={self.mode}, {limit}, policy={policy_name(self._policy)!r})"
        )

    # ---- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Close the database connection and free the workspace; plans made so far are kept in memory."""
        if self._cache is not None:
            self._cache.close()
        self._cache = None
        self._cache_open = False
        self.release_workspace()

    def release_workspace(self) -> None:
        """Free the workspace the handle keeps between runs (its WR buffer, its WD arena); the next run that
        needs it takes it again. A memory plan's step gives it back (`ucudnn.torch.execute_plan`): its
        kernels run in workspaces of their own, held for one run, and the plan counts no other."""
        self._buffer = None
        self._buffer_bytes = 0
        self._arena = None
        self._slices = (None, {})

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce__(self):
        # A copy (pickle, copy.deepcopy of a model) is a fresh handle with the same options: the
        # database connection and the workspace cannot travel, and plans come back from the DB.
        return (_rebuild_handle, (self._options,))

    # ---- announcing layers (WD) -----------------------------------------------------------
    def register(self, layer: str, problem: ConvProblem, *, kinds: Iterable[str] = KINDS) -> None:
        """Announce that `layer` runs `problem`'s convolution with these kernel kinds.

        `problem` describes the layer's geometry; its `kind` and batch `n` are ignored (plans are
        solved per batch as batches arrive). In WD, announce every layer before the first
        convolution: that convolution solves the network. Announcing a new layer, a new kind or a
        new shape for a known layer after a solve warns (`LateRegistrationWarning`) and makes the
        next convolution solve again. In WR, kernels are planned independently and this only
        checks its arguments.
        """
        if not isinstance(layer, str) or not layer:
            raise InvalidInput(f"layer must be a non-empty string, got {layer!r}")
        if not isinstance(problem, ConvProblem):
            raise InvalidInput(f"problem must be a ConvProblem, got {type(problem).__name__}")
        kinds = frozenset(kinds)
        unknown = kinds - set(KINDS)
        if not kinds or unknown:
            raise InvalidInput(f"kinds must be a non-empty subset of {', '.join(KINDS)}, got {sorted(kinds)}")
        if self.mode == "WR":
            return
        self._register(layer, problem.with_kind("fwd"), kinds, stacklevel=3)

    def _register(self, layer: str, template: ConvProblem, kinds: frozenset[str], stacklevel: int) -> None:
        known = self._layers.get(layer)
        if known is not None and known[0].key == template.key:
            if kinds <= known[1]:
                return
            kinds = kinds | known[1]
            what = f"kernel kind(s) {', '.join(sorted(kinds - known[1]))} of layer {layer!r}"
        elif known is not None:
            what = f"a new shape for layer {layer!r} ({template.spec}, was {known[0].spec})"
        else:
            what = f"layer {layer!r}"
        self._layers[layer] = (template, kinds)
        if self._wd_solved:
            warnings.warn(
                LateRegistrationWarning(
                    f"ucudnn WD: {what} was announced after the workspace division was solved; the network "
                    f"({len(self._layers)} layers) is solved again. Announce every layer before the first "
                    "convolution (Handle.register, or ucudnn.torch.announce)."
                ),
                stacklevel=stacklevel,
            )
            self._wd_plans.clear()
            self._prepared.clear()
            self._generation += 1

    def front(self, problem: ConvProblem) -> list[Configuration]:
        """The kernel's options as its caller pays for them: the Pareto front of time against
        workspace (ascending workspace, strictly descending time) within the handle's limit (WR's
        per kernel, WD's total), measuring what the cache lacks. With a `call_overhead`, each
        configuration but native undivided carries the charge in its time. A memory planner picks
        one of these per kernel as its budget (`kernel(..., budget=...)` then runs it)."""
        limit = self._front_limit
        table = self._measure(problem, limit, front=True)
        try:
            front = pareto.front(table, problem.n, limit)
        except Infeasible as exc:
            raise Infeasible(f"{problem.spec} ({problem.kind}): {exc}") from exc
        if not self._call_overhead:
            return front
        charged, _ = charged_fronts({problem.key: front}, {problem.key: table}, problem.n, limit, self._call_overhead)
        # the charge can make a member dominated (native undivided, uncharged, may now beat it)
        kept: list[Configuration] = []
        for config in sorted(charged[problem.key], key=lambda c: (c.workspace, c.time)):
            if not kept or config.time < kept[-1].time:
                kept.append(config)
        return kept

    @property
    def _front_limit(self) -> int | None:
        """What a kernel's options are measured within: WR's per-kernel limit, WD's total."""
        return self._workspace_limit if self.mode == "WR" else self._total_workspace

    def native(self, problem: ConvProblem) -> Configuration | None:
        """Torch's own convolution on the whole batch as this handle measures it (what a converted layer runs
        where its trials settled on torch), or None where `native` is not among its candidates."""
        if NATIVE not in self._candidates(problem):
            return None
        table = self._measure(problem, self._front_limit, front=True)
        micro = next((m for m in table.get(problem.n, ()) if m.algo == NATIVE and m.usable), None)
        return None if micro is None else Configuration((micro,))

    # ---- planning -----------------------------------------------------------------------
    def _prepare(self, layer: str | None, problem: ConvProblem, budget: int | None = None) -> _Prepared:
        if layer is not None and (not isinstance(layer, str) or not layer):
            raise InvalidInput(f"layer must be a non-empty string or None, got {layer!r}")
        name = layer if layer is not None else problem.with_kind("fwd").key
        if budget is not None:
            limit = self._wr_limit(budget)
            config = (
                self._kept_within(problem, limit)
                or self._front_within(problem, limit)
                or self._plan_wr(problem, budget=budget).config
            )
            prep = _prepared(self._backend, problem, config, None, budget)
            return self._with_trial(prep, limit)
        if self.mode == "WR":
            plan = self._plan_wr(problem)
            self._wr_seen.setdefault((name, problem.kind, problem.n), problem)
            prep = self._with_trial(_prepared(self._backend, problem, plan.config, None), self._wr_limit(None))
        else:
            self._register(name, problem.with_kind("fwd"), frozenset({problem.kind}), stacklevel=5)
            plans = self._wd_plans.get(problem.n)
            if plans is None:
                plans = self._solve_wd(problem.n)
            _, plan = plans[name, problem.kind]
            # a trial's native run needs no segment (torch allocates for itself): within the total
            prep = _prepared(self._backend, problem, plan.config, plan.offset)
            prep = self._with_trial(prep, self._total_workspace)
        return prep


def _rebuild_handle(options: dict) -> Handle:
    return Handle(**options)
