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
"""

from __future__ import annotations

import dataclasses
import math
import operator
import statistics
import sys
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ucudnn.backends import get_backend
from ucudnn.backends.base import Backend, one_line
from ucudnn.backends.cpu import NATIVE
from ucudnn.kernel.measure import (BenchStats, Policy, batch_sizes, confirm_faster, device_key, measure_table,
                              parse_policy, policy_name)
from ucudnn.kernel.call_overhead import charged_fronts, native_undivided
from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.kernel.run import PreparedConfiguration
from ucudnn.kernel.plans import micro_from_json, micro_to_json, pareto_fronts, plan_key, undivided_baseline
from ucudnn.problem import KINDS, ConvProblem
from ucudnn.kernel.resources import check_can_run
from ucudnn.sizes import parse_size
from ucudnn.solver import pareto, wr
from ucudnn.solver.types import Configuration, Infeasible, MicroConfig

__all__ = ["Handle", "Kernel", "KernelChoice", "LateRegistrationWarning", "PlanFailureWarning", "SEGMENT_ALIGN_BYTES"]

# WD segments start at multiples of this: cuDNN wants aligned workspace pointers, and on the CPU an
# aligned start keeps float views of a segment on cache-line (and SIMD) boundaries.
SEGMENT_ALIGN_BYTES = 256

# Databases spelled as "keep nothing across processes": mapped to SQLAlchemy's in-memory SQLite.
_IN_MEMORY_DB = (":memory:", "sqlite://", "sqlite:///:memory:")

_Pair = int | Sequence[int]


class LateRegistrationWarning(UserWarning):
    """A WD layer was announced after the network was solved; the network is solved again."""


class PlanFailureWarning(UserWarning):
    """A planned algorithm could not run; it was recorded as unusable and the kernel re-planned."""


# Re-plans of one call before giving up. Each records at least one more unusable (algorithm,
# micro-batch), so this only bounds a backend whose failures move from size to size.
_MAX_REPLANS = 16


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


@dataclass(frozen=True, slots=True)
class _Plan:
    """A kernel's solved configuration, its baseline and (WD) its arena offset."""

    config: Configuration
    baseline: MicroConfig | None
    offset: int | None = None


@dataclass(frozen=True, slots=True)
class _Prepared:
    """What a repeated call needs, looked up by the call's shapes and parameters alone."""

    problem: ConvProblem
    config: Configuration
    offset: int | None  # WD segment offset; None in WR (the shared buffer)
    kernels: PreparedConfiguration  # micro-batch problems, rows and launchers, made once
    out_shape: tuple[int, int, int, int]  # problem.out_shape, which is derived per access
    budget: int | None = None  # planned within a caller's budget: its workspace is taken per run
    trial: _Trial | None = None  # timed against native undivided where it runs, for its first runs


@dataclass(slots=True)
class _Trial:
    """A planned kernel against torch's own convolution on the whole batch, timed where the caller
    runs it (inside its training step, where caches and thread pools are as they really are):
    the two take turns for the first runs, then the faster stays (`Handle(trial_runs=...)`)."""

    planned: _Prepared
    native: _Prepared
    runs: int                       # timed runs of each
    calls: int = 0
    planned_ms: list[float] = dataclasses.field(default_factory=list)
    native_ms: list[float] = dataclasses.field(default_factory=list)

    @property
    def open(self) -> bool:
        return len(self.native_ms) < self.runs


def native_only(config: Configuration) -> bool:
    """`native` on the whole batch: torch's own convolution, which a torch caller can run itself."""
    return len(config.micros) == 1 and config.micros[0].algo == NATIVE


def _prepared(backend: Backend, problem: ConvProblem, config: Configuration, offset: int | None,
              budget: int | None = None) -> _Prepared:
    return _Prepared(problem, config, offset, PreparedConfiguration(backend, problem, config), problem.out_shape,
                     budget)


class Kernel:
    """One planned kernel, prepared to run again and again without a lookup (`Handle.kernel`).

    `run` takes operands of exactly the shapes, dtype and layout it was made for (the first run
    checks them in the backend; later runs only launch). It is valid while `handle.generation`
    equals `generation`: a WD re-solve moves segments and makes older kernels stale.
    """

    __slots__ = ("_handle", "_prep", "generation")

    def __init__(self, handle: Handle, prep: _Prepared, generation: int) -> None:
        self._handle, self._prep, self.generation = handle, prep, generation

    @property
    def problem(self) -> ConvProblem:
        return self._prep.problem

    @property
    def config(self) -> Configuration:
        return self._prep.config

    def run(self, *, x: Any = None, w: Any = None, dy: Any = None, out: Any, alpha: float = 1.0,
            beta: float = 0.0) -> None:
        """out = alpha * kernel(...) + beta * out, with the handle's workspace."""
        self._handle._run(self._prep, x=x, w=w, dy=dy, out=out, alpha=alpha, beta=beta)


def _pair(name: str, value: _Pair, minimum: int) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        pair = (value, value)
    else:
        try:
            pair = tuple(value)  # type: ignore[arg-type]
        except TypeError:
            raise InvalidInput(f"{name} must be an integer or a pair of integers, got {value!r}") from None
        if len(pair) != 2:
            raise InvalidInput(f"{name} must be an integer or a pair of integers, got {value!r}")
    for v in pair:
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            rule = "non-negative" if minimum == 0 else "positive"
            raise InvalidInput(f"{name} must hold {rule} integers, got {value!r}")
    return pair  # type: ignore[return-value]


def _shape4(name: str, array_or_shape: Any) -> tuple[int, int, int, int]:
    """The shape of a 4-D array, or a 4-entry shape itself, as a tuple of ints."""
    shape = getattr(array_or_shape, "shape", array_or_shape)
    if type(shape) is tuple and len(shape) == 4 and type(shape[0]) is type(shape[1]) is type(shape[2]) \
            is type(shape[3]) is int:  # the hot path: an array's own shape
        return shape
    try:
        shape = tuple(operator.index(v) for v in shape if not isinstance(v, bool))
        if len(shape) == 4:
            return shape  # type: ignore[return-value]
    except TypeError:
        pass
    raise InvalidInput(f"{name} must be a 4-D NCHW array or a shape of 4 integers, got "
                       f"{getattr(array_or_shape, 'shape', array_or_shape)!r}")


_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    """str(dtype), memoised: NumPy builds a dtype's name in Python, a few microseconds per call."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def _same_dtype(a: Any, b: Any) -> None:
    if a.dtype != b.dtype:
        raise InvalidInput(f"the two operands must share a dtype, got {a.dtype} and {b.dtype}")


def _check_no_overlap(out: Any, **inputs: Any) -> None:
    """Refuse an output that shares memory with an input: kernels write `out` while still reading
    their inputs (shift_gemm, for one, accumulates into out sample by sample)."""
    module = _array_module(out)
    for name, array in inputs.items():
        if module.may_share_memory(out, array):
            raise InvalidInput(f"out overlaps {name}: a kernel cannot write its result over an operand it "
                               f"reads; give a separate out")


def _check_groups(groups: Any, c: int, w_shape: Sequence[int]) -> None:
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise InvalidInput(f"groups must be a positive integer, got {groups!r}")
    if w_shape[1] * groups != c:
        raise InvalidInput(f"the filter's input channels ({w_shape[1]}) times groups ({groups}) must equal "
                           f"the input's channels ({c})")
    if w_shape[0] % groups:
        raise InvalidInput(f"groups ({groups}) must divide the filter's output channels ({w_shape[0]})")


def _infer_x_shape(dy_shape, w_shape, stride, padding, dilation, groups) -> tuple[int, int, int, int]:
    """The input shape of a convolution from its output and filter, where that is unambiguous."""
    stride, padding, dilation = _pair("stride", stride, 1), _pair("padding", padding, 0), _pair("dilation", dilation, 1)
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise InvalidInput(f"groups must be a positive integer, got {groups!r}")
    if stride != (1, 1):
        # out = (h + 2p - d(r-1) - 1) // stride + 1 fixes h only when the stride is 1
        raise InvalidInput("conv_backward_data cannot tell the input size from dy when the stride is above 1; "
                           "give x_shape or out")
    sizes = [dy_shape[2 + a] - 1 - 2 * padding[a] + dilation[a] * (w_shape[2 + a] - 1) + 1 for a in (0, 1)]
    return (dy_shape[0], w_shape[1] * groups, *sizes)


def _infer_w_shape(x_shape, dy_shape, stride, padding, dilation, groups) -> tuple[int, int, int, int]:
    """The filter shape of a convolution from its input and output, where that is unambiguous."""
    stride, padding, dilation = _pair("stride", stride, 1), _pair("padding", padding, 0), _pair("dilation", dilation, 1)
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise InvalidInput(f"groups must be a positive integer, got {groups!r}")
    if stride != (1, 1):
        raise InvalidInput("conv_backward_filter cannot tell the filter size from x and dy when the stride is "
                           "above 1; give w_shape or out")
    sizes = []
    for a in (0, 1):
        span = x_shape[2 + a] + 2 * padding[a] - dy_shape[2 + a]  # = dilation * (r - 1)
        if span < 0 or span % dilation[a]:
            raise InvalidInput(f"no filter size maps an input of {x_shape[2 + a]} to an output of {dy_shape[2 + a]} "
                               f"with padding {padding[a]} and dilation {dilation[a]}")
        sizes.append(span // dilation[a] + 1)
    return (dy_shape[1], x_shape[1] // groups, *sizes)


def _array_module(array: Any):
    """numpy, or cupy for a CuPy array (cupy is imported only when such an array is given)."""
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(array, cupy.ndarray):
        return cupy
    import numpy
    return numpy


def _contiguous(array: Any) -> Any:
    return array if array.flags.c_contiguous else _array_module(array).ascontiguousarray(array)


def _config_from_dict(items: Iterable[dict]) -> Configuration:
    return Configuration(tuple(micro_from_json(d) for d in items))


def _align_up(nbytes: int) -> int:
    return -(-nbytes // SEGMENT_ALIGN_BYTES) * SEGMENT_ALIGN_BYTES


def _place_segments(configs: Sequence[Configuration]) -> tuple[list[int], int]:
    """Aligned, disjoint arena offsets for the kernels' workspaces, and the bytes they span."""
    offsets, end = [], 0
    for config in configs:
        if config.workspace == 0:
            offsets.append(0)  # an empty segment; it overlaps nothing
            continue
        start = _align_up(end)
        offsets.append(start)
        end = start + config.workspace
    return offsets, end


class Handle:
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
    """

    def __init__(self, *, backend: str | Backend = "auto", policy: Policy = "powerOfTwo",
                 workspace_limit: int | str | None = None, total_workspace: int | str | None = None,
                 db: str | bool | None = None, reps: int = 3, algos: Sequence[str] | None = None,
                 call_overhead: float = 0.0, trial_runs: int = 0) -> None:
        self._options = {"backend": backend, "policy": policy, "workspace_limit": workspace_limit,
                         "total_workspace": total_workspace, "db": db, "reps": reps,
                         "algos": tuple(algos) if algos is not None else None, "call_overhead": call_overhead,
                         "trial_runs": trial_runs}
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
        if (isinstance(call_overhead, bool) or not isinstance(call_overhead, (int, float))
                or not math.isfinite(call_overhead) or call_overhead < 0):
            raise InvalidInput(f"call_overhead must be a finite number of milliseconds >= 0, got {call_overhead!r}")
        self._call_overhead = float(call_overhead)
        if isinstance(trial_runs, bool) or not isinstance(trial_runs, int) or trial_runs < 0:
            raise InvalidInput(f"trial_runs must be a non-negative integer, got {trial_runs!r}")
        self._trial_runs = trial_runs
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

        self._cache: Any = None           # opened on first use
        self._cache_open = False
        self._stats = BenchStats()
        # call signature -> what to run; WD re-solves clear it
        self._prepared: dict[tuple, _Prepared] = {}
        self._generation = 0  # bumped whenever _prepared is dropped: Kernel objects made before are stale
        # WR: (problem.key, batch, limit) -> plan; one workspace buffer shared by every kernel
        self._wr_plans: dict[tuple[str, int, int | None], _Plan] = {}
        self._wr_seen: dict[tuple[str, str, int], ConvProblem] = {}
        self._buffer: Any = None
        self._buffer_bytes = 0
        # called with +bytes and -bytes around a run whose workspace is held for that run only (a
        # plan's budget); set by `ucudnn.torch.tracker.StepTracker` while it counts
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
        """"WD" with a total workspace, else "WR"."""
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
        return (self._buffer_bytes if self._buffer is not None else 0) + \
            (int(self._arena.nbytes) if self._arena is not None else 0)

    @property
    def arena(self) -> Any:
        """The WD arena (one buffer of `total_workspace` bytes, allocated at the first solve), else None."""
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
        limit = (f"workspace_limit={self._workspace_limit}" if self.mode == "WR"
                 else f"total_workspace={self._total_workspace}")
        return (f"Handle(backend={self._backend.name!r}, mode={self.mode}, {limit}, "
                f"policy={policy_name(self._policy)!r})")

    # ---- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Close the database connection and free the workspace; plans made so far are kept in memory."""
        if self._cache is not None:
            self._cache.close()
        self._cache = None
        self._cache_open = False
        self._buffer = None
        self._buffer_bytes = 0
        self._arena = None

    def __enter__(self) -> Handle:
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
            warnings.warn(LateRegistrationWarning(
                f"ucudnn WD: {what} was announced after the workspace division was solved; the network "
                f"({len(self._layers)} layers) is solved again. Announce every layer before the first "
                "convolution (Handle.register, or ucudnn.torch.announce)."), stacklevel=stacklevel)
            self._wd_plans.clear()
            self._prepared.clear()
            self._generation += 1

    # ---- the three kernels --------------------------------------------------------------
    def conv_forward(self, x: Any, w: Any, *, stride: _Pair = 1, padding: _Pair = 0, dilation: _Pair = 1,
                     groups: int = 1, alpha: float = 1.0, beta: float = 0.0, out: Any = None,
                     layer: str | None = None) -> Any:
        """y = alpha * conv2d(x, w) + beta * out, for x (n, c, h, w) and w (k, c/groups, r, s).

        Without `out`, a new y is allocated and returned (`beta` must then be 0). With `out` (a
        contiguous array of y's shape and dtype), the result is written into it and `out` is
        returned. `layer` names the layer (WD gives each layer's kernels their own segment; None
        uses the shape as the name, so layers of one shape share a segment).
        """
        xs, ws = _shape4("x", x), _shape4("w", w)
        _same_dtype(x, w)
        prep = self._lookup("fwd", layer, xs, ws, stride, padding, dilation, groups, _dtype_name(x.dtype))
        out = self._output(out, prep, beta, x, x=x, w=w)
        self._run(prep, x=_contiguous(x), w=_contiguous(w), out=out, alpha=alpha, beta=beta)
        return out

    def conv_backward_data(self, dy: Any, w: Any, *, x_shape: Sequence[int] | None = None, stride: _Pair = 1,
                           padding: _Pair = 0, dilation: _Pair = 1, groups: int = 1, alpha: float = 1.0,
                           beta: float = 0.0, out: Any = None, layer: str | None = None) -> Any:
        """dx = alpha * (gradient of conv2d w.r.t. its input, given dy) + beta * out.

        The input shape comes from `x_shape`, or from `out`'s shape; without either it is inferred
        where that is unambiguous (stride 1 on both axes). The rest is as in `conv_forward`.
        """
        dys, ws = _shape4("dy", dy), _shape4("w", w)
        _same_dtype(dy, w)
        if x_shape is None:
            x_shape = out.shape if out is not None else _infer_x_shape(dys, ws, stride, padding, dilation, groups)
        prep = self._lookup("bwd_data", layer, _shape4("x_shape", x_shape), ws, stride, padding, dilation, groups,
                            _dtype_name(dy.dtype))
        if dys != prep.problem.y_shape:
            raise InvalidInput(f"dy has shape {dys}, but the convolution of an input {prep.problem.x_shape} with "
                               f"w {ws} writes {prep.problem.y_shape}")
        out = self._output(out, prep, beta, dy, dy=dy, w=w)
        self._run(prep, dy=_contiguous(dy), w=_contiguous(w), out=out, alpha=alpha, beta=beta)
        return out

    def conv_backward_filter(self, x: Any, dy: Any, *, w_shape: Sequence[int] | None = None, stride: _Pair = 1,
                             padding: _Pair = 0, dilation: _Pair = 1, groups: int = 1, alpha: float = 1.0,
                             beta: float = 0.0, out: Any = None, layer: str | None = None) -> Any:
        """dw = alpha * (gradient of conv2d w.r.t. its filter, given x and dy) + beta * out.

        The filter shape comes from `w_shape`, or from `out`'s shape; without either it is inferred
        where that is unambiguous (stride 1 on both axes). Micro-batch gradients are summed into
        the result. The rest is as in `conv_forward`.
        """
        xs, dys = _shape4("x", x), _shape4("dy", dy)
        _same_dtype(x, dy)
        if w_shape is None:
            w_shape = out.shape if out is not None else _infer_w_shape(xs, dys, stride, padding, dilation, groups)
        prep = self._lookup("bwd_filter", layer, xs, _shape4("w_shape", w_shape), stride, padding, dilation, groups,
                            _dtype_name(x.dtype))
        if dys != prep.problem.y_shape:
            raise InvalidInput(f"dy has shape {dys}, but the convolution of x {xs} with a filter "
                               f"{prep.problem.w_shape} writes {prep.problem.y_shape}")
        out = self._output(out, prep, beta, x, x=x, dy=dy)
        self._run(prep, x=_contiguous(x), dy=_contiguous(dy), out=out, alpha=alpha, beta=beta)
        return out

    def prepare(self, kind: str, x_shape: Sequence[int], w_shape: Sequence[int], *, stride: _Pair = 1,
                padding: _Pair = 0, dilation: _Pair = 1, groups: int = 1, dtype: str = "float32",
                layer: str | None = None) -> Configuration:
        """Plan a kernel now (measuring and solving if needed) and return the configuration it runs.

        The arguments describe the convolution as the kernel calls do: `x_shape` (n, c, h, w) and
        `w_shape` (k, c/groups, r, s) for every kind. The call that follows with the same arguments
        runs exactly this configuration; like cudnnGet*Algorithm, this lets a framework plan during
        setup, or inspect the plan. (WD: the first `prepare` solves the network, as a convolution
        would.) The workspace is taken when the kernel first runs through the handle.
        """
        if kind not in KINDS:
            raise InvalidInput(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        return self._lookup(kind, layer, _shape4("x_shape", x_shape), _shape4("w_shape", w_shape), stride, padding,
                            dilation, groups, str(dtype)).config

    def kernel(self, kind: str, x_shape: Sequence[int], w_shape: Sequence[int], *, stride: _Pair = 1,
               padding: _Pair = 0, dilation: _Pair = 1, groups: int = 1, dtype: str = "float32",
               layout: str = "NCHW", layer: str | None = None, budget: int | None = None) -> Kernel:
        """`prepare`, returning the planned kernel itself, ready to run without a lookup.

        For frameworks that call one layer's kernels many times (``ucudnn.torch`` holds one per
        layer and shape): `Kernel.run` skips the per-call lookup and checks, and `layout`
        ("NHWC": channels-last operands, logical NCHW shapes) and `dtype` (say "bfloat16", whose
        arrays hold raw 16-bit words) describe operands whose array dtype does not say it.

        `budget` (bytes): a memory plan's workspace for this kernel. The kernel then runs the
        fastest configuration within it (and within the handle's own WR limit), WR-style in either
        mode, and takes its workspace for each run rather than from the handle's shared buffer or
        arena: the plan counted that memory at this kernel's step only.
        """
        if kind not in KINDS:
            raise InvalidInput(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise InvalidInput(f"budget must be a non-negative number of bytes or None, got {budget!r}")
        prep = self._lookup(kind, layer, _shape4("x_shape", x_shape), _shape4("w_shape", w_shape), stride, padding,
                            dilation, groups, str(dtype), layout, budget)
        return Kernel(self, prep, self._generation)

    def front(self, problem: ConvProblem) -> list[Configuration]:
        """The kernel's options as its caller pays for them: the Pareto front of time against
        workspace (ascending workspace, strictly descending time) within the handle's limit (WR's
        per kernel, WD's total), measuring what the cache lacks. With a `call_overhead`, each
        configuration but native undivided carries the charge in its time. A memory planner picks
        one of these per kernel as its budget (`kernel(..., budget=...)` then runs it)."""
        limit = self._workspace_limit if self.mode == "WR" else self._total_workspace
        table = self._measure(problem, limit)
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

    def _lookup(self, kind: str, layer: str | None, x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: _Pair,
                padding: _Pair, dilation: _Pair, groups: int, dtype: str, layout: str = "NCHW",
                budget: int | None = None) -> _Prepared:
        """What to run for this call: a dict hit on repeated calls, else the problem is built and planned."""
        signature = (kind, layer, x_shape, w_shape, stride, padding, dilation, groups, dtype, layout, budget)
        try:
            prep = self._prepared.get(signature)
        except TypeError:  # an unhashable argument (a list for stride, ...): normalised below
            prep = None
        if prep is not None:
            return prep
        stride, padding, dilation = (_pair("stride", stride, 1), _pair("padding", padding, 0),
                                     _pair("dilation", dilation, 1))
        _check_groups(groups, x_shape[1], w_shape)
        n, c, h, w = x_shape
        problem = ConvProblem(kind=kind, n=n, c=c, h=h, w=w, k=w_shape[0], r=w_shape[2], s=w_shape[3],
                              pad_h=padding[0], pad_w=padding[1], stride_h=stride[0], stride_w=stride[1],
                              dilation_h=dilation[0], dilation_w=dilation[1], groups=groups, dtype=dtype,
                              layout=layout)
        prep = self._prepare(layer, problem, budget)
        try:
            self._prepared[signature] = prep
        except TypeError:
            pass
        # the normalised spelling too, so that equal calls spelled differently hit the same entry
        self._prepared[(kind, layer, x_shape, w_shape, stride, padding, dilation, groups, dtype, layout, budget)] = prep
        return prep

    # ---- outputs --------------------------------------------------------------------------
    def _output(self, out: Any, prep: _Prepared, beta: float, like: Any, **inputs: Any) -> Any:
        problem = prep.problem
        if out is None:
            if beta != 0:
                raise InvalidInput(f"beta={beta} blends the result into an existing output; give out")
            # Zeros, not empty: with beta = 0 a backend may still read out (0 * NaN is NaN).
            return _array_module(like).zeros(prep.out_shape, dtype=like.dtype)
        if tuple(out.shape) != prep.out_shape:
            raise InvalidInput(f"out has shape {tuple(out.shape)}, the {problem.kind} kernel writes {problem.out_shape}")
        if out.dtype != like.dtype:
            raise InvalidInput(f"out has dtype {out.dtype}, the operands {like.dtype}")
        if not out.flags.c_contiguous:
            raise InvalidInput("out must be C-contiguous (NCHW); the kernel writes into it in place")
        if _array_module(out) is not _array_module(like):
            raise InvalidInput("out and the operands must live on the same device (NumPy or CuPy arrays alike)")
        _check_no_overlap(out, **inputs)
        return out

    # ---- planning -----------------------------------------------------------------------
    def _prepare(self, layer: str | None, problem: ConvProblem, budget: int | None = None) -> _Prepared:
        if layer is not None and (not isinstance(layer, str) or not layer):
            raise InvalidInput(f"layer must be a non-empty string or None, got {layer!r}")
        name = layer if layer is not None else problem.with_kind("fwd").key
        if budget is not None:
            prep = _prepared(self._backend, problem, self._plan_wr(problem, budget=budget).config, None, budget)
            return self._with_trial(prep, self._wr_limit(budget))
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

    def _with_trial(self, prep: _Prepared, limit: int | None) -> _Prepared:
        """`prep` with a trial against native undivided, where trials are asked for and native can
        run this problem within `limit` (the trial runs it)."""
        problem = prep.problem
        if (not self._trial_runs or native_only(prep.config) or NATIVE not in self._candidates(problem)
                or self._backend.unsupported_reason(problem, NATIVE) is not None):
            return prep
        workspace = self._backend.workspace_size(problem, NATIVE)
        if limit is not None and workspace > limit:
            return prep
        native = _prepared(self._backend, problem, Configuration((MicroConfig(NATIVE, problem.n, 0.0, workspace),)),
                           None, prep.budget)
        return dataclasses.replace(prep, trial=_Trial(prep, native, self._trial_runs))

    def _candidates(self, problem: ConvProblem) -> list[str]:
        if self._algos is None:
            return self._backend.algorithms(problem)
        known = self._backend.algorithms(problem)
        unknown = [a for a in self._algos if a not in known]
        if unknown:
            raise InvalidInput(f"unknown algorithm(s) {', '.join(unknown)} for backend {self._backend.name} "
                               f"({problem.kind}); known: {', '.join(known)}")
        return list(self._algos)

    def _open_cache(self):
        if not self._cache_open:
            self._cache_open = True
            if self._db is not False:
                from ucudnn.db import Cache
                url = self._db
                if isinstance(url, str) and url in _IN_MEMORY_DB:
                    url = "sqlite://"
                elif url is not None:
                    url = str(url)
                self._cache = Cache(url)
        return self._cache

    def _measure(self, problem: ConvProblem, limit: int | None) -> dict[int, list[MicroConfig]]:
        check_can_run(self._backend, problem, algos=self._candidates(problem), workspace_limit=limit)
        table, stats = measure_table(self._backend, problem, batch_sizes(self._policy, problem.n),
                                     cache=self._open_cache(), algos=self._candidates(problem), reps=self._reps,
                                     workspace_limit=limit)
        self._stats += stats
        if self._failed:  # algorithms that failed in a plan this session, also without a cache
            table = {size: [self._failed.get((problem.key, m.algo, size), m) for m in row]
                     for size, row in table.items()}
        return table

    def _plan_key(self, **parts) -> str:
        if self._call_overhead:  # charged plans differ; uncharged ones keep their old keys
            parts["call_overhead_ms"] = round(self._call_overhead, 3)
        return plan_key(self._backend, policy=policy_name(self._policy), algos=self._algos, **parts)

    def _wr_limit(self, budget: int | None) -> int | None:
        """The limit a WR plan is solved within: the handle's own, or a memory plan's `budget` capped
        by it (a WD handle has none: the plan's budgets are what replace its division)."""
        if budget is None:
            return self._workspace_limit
        return budget if self._workspace_limit is None else min(self._workspace_limit, budget)

    def _plan_wr(self, problem: ConvProblem, fresh: bool = False, budget: int | None = None) -> _Plan:
        """WR: the fastest configuration within `_wr_limit(budget)`."""
        limit = self._wr_limit(budget)
        memo = (problem.key, problem.n, limit)
        plan = self._wr_plans.get(memo)
        if plan is not None:
            return plan
        key = self._plan_key(mode="WR", workspace_limit=limit, problem=problem.key, batch=problem.n)
        cache = self._open_cache()
        stored = cache.get_plan(key) if cache is not None and not fresh else None
        if stored is not None:
            plan = _Plan(_config_from_dict(stored["config"]),
                         micro_from_json(stored["baseline"]) if stored.get("baseline") else None)
        else:
            table = self._measure(problem, limit)
            try:
                config = wr.solve(table, problem.n, limit)
            except Infeasible as exc:
                raise Infeasible(f"{problem.spec} ({problem.kind}): {exc}") from exc
            baseline = undivided_baseline(table, problem.n, limit)
            native = native_undivided(table, problem.n, limit) if self._call_overhead else None
            if native is None or native.micros != (baseline,):
                config = confirm_faster(self._backend, problem, config, baseline, self._reps)
            if native is not None:  # the caller runs native undivided itself: others must win by the charge
                config = confirm_faster(self._backend, problem, config, native.micros[0], self._reps,
                                        charge_ms=self._call_overhead)
            plan = _Plan(config, baseline)
            if cache is not None:
                cache.put_plan(key, {"mode": "WR", "problem": problem.key, "batch": problem.n,
                                     "config": [micro_to_json(m) for m in config.micros],
                                     "baseline": micro_to_json(baseline) if baseline else None})
        self._wr_plans[memo] = plan
        return plan

    def _solve_wd(self, batch: int, fresh: bool = False) -> dict[tuple[str, str], tuple[ConvProblem, _Plan]]:
        """Solve (or load) the workspace division of every registered kernel at this batch."""
        total = self._total_workspace
        assert total is not None
        # A canonical kernel order, so that networks with the same multiset of kernels share a plan.
        kernels = sorted(((layer, kind, template.with_batch(batch).with_kind(kind))
                          for layer, (template, kinds) in self._layers.items() for kind in kinds),
                         key=lambda t: (t[2].key, t[0]))
        problem_keys = [p.key for _, _, p in kernels]
        key = self._plan_key(mode="WD", total_workspace=total, batch=batch, kernels=problem_keys)
        cache = self._open_cache()
        stored = cache.get_plan(key) if cache is not None and not fresh else None
        if stored is not None and len(stored.get("kernels", ())) == len(kernels):
            configs = [_config_from_dict(k["config"]) for k in stored["kernels"]]
            baselines = [micro_from_json(k["baseline"]) if k.get("baseline") else None for k in stored["kernels"]]
            offsets, end = _place_segments(configs)
        else:
            configs, baselines, offsets, end = self._solve_wd_fresh([p for _, _, p in kernels], total)
            if cache is not None:
                cache.put_plan(key, {"mode": "WD", "total_workspace": total, "batch": batch, "kernels": [
                    {"problem": p, "config": [micro_to_json(m) for m in c.micros],
                     "baseline": micro_to_json(b) if b else None}
                    for p, c, b in zip(problem_keys, configs, baselines, strict=True)]})
        if end > total:  # only a corrupt stored plan gets here; a fresh solve places within the total
            raise Infeasible(f"the stored WD plan needs {end} B of arena, over the total {total} B")
        if self._arena is None:
            self._arena = self._backend.empty_workspace(total)
        self._peak_bytes = max(self._peak_bytes, end)
        plans = {(layer, kind): (p, _Plan(c, b, o))
                 for (layer, kind, p), c, b, o in zip(kernels, configs, baselines, offsets, strict=True)}
        self._wd_plans[batch] = plans
        self._wd_solved = True
        return plans

    def _solve_wd_fresh(self, problems: list[ConvProblem], total: int):
        from ucudnn.solver import wd

        batch = problems[0].n
        tables: dict[str, dict[int, list[MicroConfig]]] = {}
        for p in problems:
            if p.key not in tables:
                tables[p.key] = self._measure(p, total)
        fronts = pareto_fronts(problems, tables, batch, total)
        originals: dict[int, Configuration] = {}
        if self._call_overhead:
            fronts, originals = charged_fronts(fronts, tables, batch, total, self._call_overhead)
        share = total // len(problems)  # the baseline: an equal share, what a framework without WD gives
        baselines = [undivided_baseline(tables[p.key], batch, share) for p in problems]
        # Aligning segment starts can push the placed span past the total by up to K * align bytes;
        # solve again with the overshoot taken off the budget until the placement fits.
        budget = total
        while True:
            chosen = wd.solve({i: fronts[p.key] for i, p in enumerate(problems)}, budget)
            configs = [originals.get(id(chosen[i]), chosen[i]) for i in range(len(problems))]
            offsets, end = _place_segments(configs)
            if end <= total:
                return configs, baselines, offsets, end
            budget -= end - total
            if budget < 0:
                raise Infeasible(f"aligned WD segments do not fit the total workspace {total} B")

    # ---- running ------------------------------------------------------------------------
    def _workspace(self, prep: _Prepared) -> Any:
        need = prep.config.workspace
        if native_only(prep.config):  # torch allocates its own temporaries: its declared size is an estimate
            return self._backend.empty_workspace(0)
        if prep.budget is not None:  # a plan's budget: held for this run only, as the plan counted it
            return self._backend.empty_workspace(need)
        if prep.offset is not None:
            if self._arena is None:  # freed by close(); the plans still hold
                self._arena = self._backend.empty_workspace(self._total_workspace)
            return self._arena[prep.offset:prep.offset + need]
        if self._buffer is None or need > self._buffer_bytes:
            self._buffer = None  # release the old buffer before taking the larger one
            self._buffer = self._backend.empty_workspace(need)
            self._buffer_bytes = need
            self._peak_bytes = max(self._peak_bytes, need)
        return self._buffer[:need]

    def _run_kernels(self, prep: _Prepared, **operands: Any) -> None:
        workspace = self._workspace(prep)
        # a budget's workspace lives for this run only: a memory tracker (`workspace_listener`) hears of it
        # (torch's own convolution takes none from us: `_workspace`)
        held = prep.config.workspace if prep.budget is not None and self.workspace_listener is not None \
            and not native_only(prep.config) else 0
        if held:
            self.workspace_listener(held)
        try:
            prep.kernels.run(workspace=workspace, **operands)
        finally:
            if held:
                self.workspace_listener(-held)

    def _run(self, prep: _Prepared, *, x: Any = None, w: Any = None, dy: Any = None, out: Any,
             alpha: float, beta: float) -> None:
        trial = prep.trial
        if trial is not None and trial.open:
            self._run_trial(prep, trial, x=x, w=w, dy=dy, out=out, alpha=alpha, beta=beta)
            return
        if not prep.kernels.checked:  # its first run: a configuration that cannot run is re-planned
            self._run_first(prep, x=x, w=w, dy=dy, out=out, alpha=alpha, beta=beta)
            return
        try:
            self._run_kernels(prep, x=x, w=w, dy=dy, out=out, alpha=alpha, beta=beta)
        except self._candidate_failures() as exc:
            if beta != 0:  # out already holds part of the blend: no way back to the caller's values
                raise
            self._run_first(self._replan(prep, exc), x=x, w=w, dy=dy, out=out, alpha=alpha, beta=beta)

    def _run_trial(self, prep: _Prepared, trial: _Trial, **call: Any) -> None:
        """One run of a trial (see `trial_runs`): the plan and native take turns, the first run of
        each untimed (it is checked, and may re-plan); at the end native replaces the plan unless
        the plan's median won by more than the call overhead."""
        native = trial.calls % 2 == 1
        trial.calls += 1
        start = time.perf_counter()
        self._run(trial.native if native else trial.planned, **call)
        if trial.calls <= 2:
            return
        (trial.native_ms if native else trial.planned_ms).append((time.perf_counter() - start) * 1e3)
        if not trial.open and statistics.median(trial.planned_ms) + self._call_overhead >= \
                statistics.median(trial.native_ms):
            self._switch(prep, trial.native)

    def _switch(self, old: _Prepared, new: _Prepared) -> None:
        """Every call planned as `old` runs `new` from now on; kernels made before are stale."""
        for signature, prep in list(self._prepared.items()):
            if prep is old:
                self._prepared[signature] = new
        self._generation += 1

    # ---- recovery from planned algorithms that cannot run ----------------------------------
    def _candidate_failures(self) -> tuple[type[BaseException], ...]:
        return (UnsupportedProblem, MemoryError, *self._backend.candidate_failures())

    def _run_first(self, prep: _Prepared, *, out: Any, beta: float, **operands: Any) -> None:
        """Run a configuration that has not run before: one that cannot run is recorded and re-planned.

        Every micro-batch's algorithm is checked before anything is written; for a failure while
        running, `out` is restored from a copy taken first when beta != 0 reads it.
        """
        for _ in range(_MAX_REPLANS):
            failures = [MicroConfig(m.algo, m.batch, float("inf"), 0, reason=reason)
                        for m in dict.fromkeys(prep.config.micros)
                        if (reason := self._backend.unsupported_reason(prep.problem.with_batch(m.batch), m.algo))]
            if failures:
                prep = self._replan(prep, UnsupportedProblem(failures[0].reason), failures)
                continue
            saved = out.copy() if beta != 0 else None
            try:
                self._run_kernels(prep, out=out, beta=beta, **operands)
            except self._candidate_failures() as exc:
                if saved is not None:
                    out[...] = saved
                prep = self._replan(prep, exc)
                continue
            return
        raise UnsupportedProblem(f"{prep.problem.spec} ({prep.problem.kind}): no runnable configuration after "
                                 f"{_MAX_REPLANS} re-plans")

    def _replan(self, prep: _Prepared, exc: BaseException, failures: Sequence[MicroConfig] = ()) -> _Prepared:
        """Record the failed algorithms as unusable (cache and this session), solve again, warn once."""
        problem = prep.problem
        sizes = batch_sizes(self._policy, problem.n)
        if failures:  # did not build: so at every other size where it does not build either
            failures = [MicroConfig(algo, size, float("inf"), 0, reason=reason)
                        for algo in dict.fromkeys(m.algo for m in failures) for size in sizes
                        if (reason := self._backend.unsupported_reason(problem.with_batch(size), algo))]
        else:  # failed while running: the plan's algorithms are suspect at every size
            failures = [MicroConfig(algo, size, float("inf"), 0, reason=f"failed to run: {one_line(exc)}")
                        for algo in dict.fromkeys(m.algo for m in prep.config.micros) for size in sizes]
        for m in failures:
            self._failed[problem.key, m.algo, m.batch] = m
        cache = self._open_cache()
        if cache is not None and not isinstance(exc, MemoryError):  # out of memory says nothing lasting
            cache.store(problem_key=problem.key, micros=failures, replace=True, **device_key(self._backend))
        if not self._warned_failure:
            self._warned_failure = True
            warnings.warn(PlanFailureWarning(
                f"{', '.join(m.algo for m in failures)} could not run {problem.spec} ({problem.kind}): "
                f"{failures[0].reason}; recorded as unusable and re-planned (later failures are not warned)"),
                stacklevel=5)
        self._prepared.clear()
        self._generation += 1  # Kernel objects holding the failed plan are stale
        if prep.budget is not None or self.mode == "WR":
            self._wr_plans.pop((problem.key, problem.n, self._wr_limit(prep.budget)), None)
            return _prepared(self._backend, problem, self._plan_wr(problem, fresh=True, budget=prep.budget).config,
                             None, prep.budget)
        self._wd_plans.pop(problem.n, None)
        plans = self._solve_wd(problem.n, fresh=True)
        plan = next(plan for p, plan in plans.values() if p == problem)
        return _prepared(self._backend, problem, plan.config, plan.offset)


def _rebuild_handle(options: dict) -> Handle:
    return Handle(**options)
