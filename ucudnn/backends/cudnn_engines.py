"""cuDNN engine configs as ucudnn's algorithms: naming them, enumerating what the heuristics offer
for a graph, and building one into an execution plan (or saying why it does not build).

An algorithm is an engine config, named by `(engine_id, knobs)` as a stable string such as
`eng3:SPLIT_K_BUF=2,TILEK=0` (knobs by their `cudnn.knob_type` name, sorted), with the suffix
`+fp32acc` when a half-precision layer computes in float32 (paper §III-D, precision promotion).

API followed (nvidia-cudnn-frontend 1.32, read from its installed sources and NVIDIA/cudnn-frontend):
- the plan sequence validate -> build_operation_graph -> create_execution_plans([A, FALLBACK])
  -> check_support -> build: test/python/conv/graph/test_conv_fuzzer.py and test_wgrads.py;
- `create_execution_plans` is one-shot on a `cudnn.pygraph` (a second call raises), so modes A
  and FALLBACK go in ONE call; `get_engine_and_knobs_at_index`, `build_plan_at_index` and
  `get_workspace_size_plan_at_index` address the ranked list: cudnn/_pygraph.py;
- replaying a recorded choice with `create_execution_plan(engine_id, knobs)` on a fresh graph and
  addressing it as `get_execution_plan_count() - 1`: cudnn/_pygraph.py
  (`pygraph.create_execution_plan`) and cudnn/engines/engine_ids.py.

Every problem here is an ordinary convolution: the backend passes a transposed one lowered.
"""

from __future__ import annotations

import collections
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ucudnn.backends.base import one_line
from ucudnn.backends.cudnn_graph import DeclaredGraph, declare_graph
from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.problem import ConvProblem

log = logging.getLogger("ucudnn.backends.cudnn")

# Engine ids below this are cuDNN backend engines; 10_000 and up are the frontend's own C++ and
# Python engines, which need other runtimes (cudnn/engines/engine_ids.py).
BACKEND_ENGINE_ID_LIMIT = 10_000
PROMOTED_SUFFIX = "+fp32acc"
# The knob_type member the heuristics list beside real knobs; it sets nothing and cannot be passed back.
PLACEHOLDER_KNOB = "NOT_SET"
HALF_DTYPES = ("float16", "bfloat16")

_ALGO_NAME = re.compile(
    r"^eng(?P<engine>\d+)(?::(?P<knobs>[A-Za-z0-9_]+=-?\d+(?:,[A-Za-z0-9_]+=-?\d+)*))?"
    r"(?P<promoted>\+fp32acc)?$"
)
# What the frontend raises when a graph, an engine config or a plan cannot be used. RuntimeError is
# how the binding reports a rejected descriptor or a failed build; ValueError and IndexError are
# how the Python graph reports a plan it refuses to address.
BUILD_ERRORS_EXTRA = (RuntimeError, ValueError, IndexError)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """A cuDNN engine config as ucudnn names it: engine id, knob settings, and compute promotion."""

    engine_id: int
    knobs: tuple[tuple[str, int], ...] = ()  # (knob_type name, value), sorted by name
    promoted: bool = False  # a half-precision layer computed in float32

    @property
    def name(self) -> str:
        knobs = ",".join(f"{knob}={value}" for knob, value in self.knobs)
        return f"eng{self.engine_id}" + (f":{knobs}" if knobs else "") + (PROMOTED_SUFFIX if self.promoted else "")

    @classmethod
    def parse(cls, name: str) -> EngineConfig:
        """Read a name written by `name`; raises InvalidInput on anything else."""
        match = _ALGO_NAME.match(name) if isinstance(name, str) else None
        if match is None:
            raise InvalidInput(
                f"{name!r} is not a cudnn algorithm name; expected e.g. 'eng3:SPLIT_K_BUF=2,TILEK=0' or 'eng0+fp32acc'"
            )
        knobs = []
        if match["knobs"]:
            for item in match["knobs"].split(","):
                knob, _, value = item.partition("=")
                knobs.append((knob, int(value)))
        if len({knob for knob, _ in knobs}) != len(knobs):
            raise InvalidInput(f"cudnn algorithm name {name!r} sets a knob twice")
        return cls(int(match["engine"]), tuple(sorted(knobs)), bool(match["promoted"]))

    @classmethod
    def from_frontend(cls, engine_id: int, knobs: Mapping[Any, int], promoted: bool) -> EngineConfig:
        """From `graph.get_engine_and_knobs_at_index`: an id and a `{cudnn.knob_type: int}` dict."""
        return cls(int(engine_id), tuple(sorted((knob.name, int(value)) for knob, value in knobs.items())), promoted)

    def frontend_knobs(self, cudnn: Any) -> dict[Any, int]:
        """The `{cudnn.knob_type: int}` dict `graph.create_execution_plan` takes.

        `get_engine_and_knobs_at_index` reports a placeholder knob, NOT_SET, which the name keeps
        (names in users' caches carry it) but `create_execution_plan` rejects with
        CUDNN_STATUS_INVALID_VALUE, so it is left out here.
        """
        try:
            return {cudnn.knob_type[knob]: value for knob, value in self.knobs if knob != PLACEHOLDER_KNOB}
        except KeyError as exc:
            raise UnsupportedProblem(
                f"{self.name}: knob {exc.args[0]} is unknown to cudnn-frontend {cudnn.__version__}"
            ) from None


@dataclass(frozen=True, slots=True)
class Plan:
    """A built execution plan: the graph that holds it, its index there, and its workspace."""

    declared: DeclaredGraph
    index: int
    workspace_bytes: int


@dataclass(frozen=True, slots=True)
class Enumeration:
    """Every engine config the heuristics offered for one graph, by name -> plan index."""

    declared: DeclaredGraph | None
    indices: dict[str, int]
    reason: str = ""  # why nothing was offered


class Lru:
    """A bounded mapping that forgets the least recently used entry."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: Any) -> Any:
        if key not in self._items:
            return None
        self._items.move_to_end(key)
        return self._items[key]

    def put(self, key: Any, value: Any) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


def promotions(problem: ConvProblem) -> tuple[bool, ...]:
    """The compute variants offered: as declared, and float32 for half-precision io."""
    if problem.dtype in HALF_DTYPES and problem.effective_compute_type != "float32":
        return (False, True)
    return (False,)


def enumerate_engines(cudnn: Any, problem: ConvProblem, promoted: bool, handle: Any) -> Enumeration:
    """Every engine config the heuristics (modes A and FALLBACK) offer for the problem's graph, best
    ranked first, or why none is."""
    declared = declare_graph(cudnn, problem, promoted=promoted, handle=handle)
    graph = declared.graph
    try:
        graph.validate()
        graph.build_operation_graph()
        # One call with both modes: planning is one-shot on a cudnn.pygraph.
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        count = graph.get_execution_plan_count()
    except (cudnn.cudnnGraphNotSupportedError, *BUILD_ERRORS_EXTRA) as exc:
        enumeration = Enumeration(None, {}, one_line(exc))
        log.debug("cudnn offers no engine for %s (%s): %s", problem.spec, problem.kind, enumeration.reason)
        return enumeration
    indices: dict[str, int] = {}
    for index in range(count):
        try:
            engine_id, knobs = graph.get_engine_and_knobs_at_index(index)
        except NotImplementedError:  # the delegating "backend's own choice" entry: nothing to name
            continue
        if not 0 <= engine_id < BACKEND_ENGINE_ID_LIMIT:
            continue
        # The list is already ranked and de-duplicated by (engine, knobs); keep the first anyway.
        indices.setdefault(EngineConfig.from_frontend(engine_id, knobs, promoted).name, index)
    return Enumeration(declared, indices, "" if indices else "the heuristics offered no cuDNN engine")


def static_reason(problem: ConvProblem, algo: str) -> tuple[EngineConfig | None, str | None]:
    """The engine config a name stands for, or why it cannot be one for this problem (no frontend call)."""
    try:
        config = EngineConfig.parse(algo)
    except InvalidInput as exc:
        return None, str(exc)
    if config.promoted and True not in promotions(problem):
        return None, (
            f"{algo}: {PROMOTED_SUFFIX} promotes half-precision io to float32 compute; this problem "
            f"has dtype {problem.dtype} and compute type {problem.effective_compute_type}"
        )
    if config.engine_id >= BACKEND_ENGINE_ID_LIMIT:
        return None, f"{algo}: engine ids from {BACKEND_ENGINE_ID_LIMIT} on are not cuDNN backend engines"
    return config, None


def build_plan(
    cudnn: Any, problem: ConvProblem, algo: str, config: EngineConfig, enumeration: Enumeration | None, handle: Any
) -> Plan | str:
    """The built plan of engine config `algo` at `problem.n`, or why it does not build.

    From the enumeration that offered it when there is one; otherwise (a name recorded earlier, in
    the cache or at another batch size) exactly that engine config rebuilt on a fresh graph.
    """
    try:
        if enumeration is not None and algo in enumeration.indices:
            declared, index = enumeration.declared, enumeration.indices[algo]
            assert declared is not None  # an enumeration that offered engine configs holds their graph
            graph = declared.graph
        else:
            declared = declare_graph(cudnn, problem, promoted=config.promoted, handle=handle)
            graph = declared.graph
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plan(config.engine_id, config.frontend_knobs(cudnn))
            index = graph.get_execution_plan_count() - 1
            graph.check_support()
        graph.build_plan_at_index(index)
        return Plan(declared, index, int(graph.get_workspace_size_plan_at_index(index)))
    except (cudnn.cudnnGraphNotSupportedError, UnsupportedProblem, *BUILD_ERRORS_EXTRA) as exc:
        reason = f"{algo} does not build for this problem: {one_line(exc)}"
        log.debug("%s (%s, %s)", reason, problem.spec, problem.kind)
        return reason
