"""What recomputing a feature map costs the host, measured on the model: the figure a plan charges each
replayed operation beyond the operation's own time (`TrainingGraph.replay_host_ms`).

A dropped map costs more than its producer's forward time: the executor (`ucudnn.torch.running.executor`) follows
the module call that makes it through a dispatch mode, records the operation's arguments, leaves a handle
in place of the saved tensor, and in the backward pass maps the recorded arguments and replays the
operation. That is Python on every dropped map: on a 2-core CPU at batch 4, 64 px, one thread, 0.2-0.5 ms
per replayed operation in MobileNetV2 and MONAI's UNet, where the operations themselves take 0.01-0.5 ms, and
three to four times what the same code costs on a chain of tiny layers run back to back (70 us per dropped
PReLU output), where its code and data stay in the caches. So it is measured on the model itself, in the
state its steps leave the caches in: steps under a plan that drops a few maps against plain steps,
interleaved, less the dropped maps' replayed operations as the timed steps measured them
(`ucudnn.torch.planning.planner._op_times`), per operation the plan's simulation replays.

The maps measured are spread over the model, each the only one dropped in its module call: maps dropped in
a run share their call's following, so a plan dropping runs costs less than it is charged (MobileNetV2's
halfway plan predicts 1.29x its step and runs 1.13x).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.memory.graph import TrainingGraph
from ucudnn.memory.plan import MemoryPlan, TensorAction
from ucudnn.memory.simulate import expand
from ucudnn.torch.capturing.capture import CapturedStep, state_kept
from ucudnn.torch.converting.layer import as_torch
from ucudnn.torch.running.executor import execute_plan
from ucudnn.torch.running.recompute import programs_for

__all__ = ["replay_host_ms"]

log = logging.getLogger("ucudnn.torch.planning.replay_cost")

SAMPLE = 8  # maps dropped in the measured plan, spread over the model
REPS = 9  # pairs of steps at most, after an untimed pair: as many as fit in BUDGET_S, 3 at least
BUDGET_S = 1.0  # (ResNet-50's 190 ms CPU steps: 3 pairs)


def replay_host_ms(
    model: nn.Module,
    step: CapturedStep,
    graph: TrainingGraph,
    args: tuple,
    kwargs: dict,
    loss: Callable,
    sample: int = SAMPLE,
    reps: int = REPS,
) -> float:
    """The executor's host time per replayed operation beyond the operation's own time, on `model` (the
    module docstring): `graph` is `step`'s, timed (its ops' `measured_ms`). 0 where the model has no map a
    plan may recompute, or the executor refuses the measured plan. The model's parameters, gradients,
    buffers and random-number state are as they were."""
    dropped = _spread(_recomputable(step, graph), sample)
    if not dropped:
        return 0.0
    actions = {s: "recompute" if s in dropped else "keep" for s in graph.storages}
    plan = MemoryPlan(
        network=graph.network,
        batch=graph.batch,
        device="measured",
        devices=1,
        memory_limit=2**62,
        policy="measure",
        fits=True,
        peak_bytes=0,
        average_bytes=0,
        baseline_peak_bytes=0,
        step_ms=1.0,
        baseline_step_ms=1.0,
        stall_ms=0.0,
        bytes_offloaded=0,
        tensors=tuple(TensorAction(s, graph.bytes_of(s), a) for s, a in actions.items()),
        conv_workspace=(),
        capture=step,
    )
    replayed = [s for s in expand(graph, actions) if s.phase == "recompute"]
    replayed_ms = sum(graph.ops[graph.op_index[s.op]].measured_ms or 0.0 for s in replayed)
    # the host's CPU time, not the wall clock, which counts whatever else ran on a shared machine: on the CPU
    # the calling thread's (the autograd engine runs a CPU graph's backward pass there too); on a GPU the
    # process's (its device threads run the backward pass)
    cuda = any(p.is_cuda for p in model.parameters())
    clock = time.process_time if cuda else time.thread_time

    def run(planned: bool) -> float:
        for p in model.parameters():
            p.grad = None
        start = clock()
        if planned:
            with execute_plan(model, plan):
                loss(model(*args, **kwargs)).backward()
        else:
            loss(model(*args, **kwargs)).backward()
        if cuda:  # pragma: no cover - needs a GPU
            torch.cuda.synchronize()
        return clock() - start

    times: dict[bool, list[float]] = {False: [], True: []}
    with state_kept(model), as_torch(), torch.enable_grad():
        try:
            pair_s = max(run(False) + run(True), 1e-6)
            for rep in range(max(3, min(reps, int(BUDGET_S / pair_s)))):  # interleaved, the order reversed every rep
                for planned in (False, True) if rep % 2 == 0 else (True, False):
                    times[planned].append(run(planned))
        except (UnsupportedProblem, InvalidInput) as exc:
            log.info("replay cost not measured on %s: %s", graph.network, exc)
            return 0.0
    # each variant's best step, the one least disturbed (on a shared machine the medians move with the load:
    # 0.34-0.6 ms per replayed op on MONAI's UNet at a load of 5 on 2 cores, the best steps 0.21-0.33)
    extra_ms = (min(times[True]) - min(times[False])) * 1e3
    return max(0.0, (extra_ms - replayed_ms) / len(replayed))


def _recomputable(step: CapturedStep, graph: TrainingGraph) -> list[str]:
    """The storages a plan may recompute from maps it holds (as `ucudnn.memory.optimal` offers them): read by
    the backward pass, not held whatever the plan, made by the model's forward pass from maps the backward
    pass reads."""
    backward = {r for s in graph.steps if s.phase == "bwd" for r in s.reads}
    out = []
    for s in graph.storages:
        producers = graph.producers(s)
        if s not in backward or s in graph.must_keep or producers[0].type == "input":
            continue
        sources = {graph.storage_of(i) for op in producers for i in op.inputs} - {s}
        if sources <= backward and s in programs_for(step, {s: "recompute"}):
            out.append(s)
    return out


def _spread(storages: list[str], k: int) -> list[str]:
    """At most `k` of `storages`, evenly spread (the first and the last among them)."""
    if len(storages) <= k:
        return storages
    return [storages[round(i * (len(storages) - 1) / (k - 1))] for i in range(k)]
