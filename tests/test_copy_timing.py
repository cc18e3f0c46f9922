"""The timing of a plan's copies in memory: the simulator holds an offloaded map until its copy out has ended and
a prefetched one from the moment the executor issues its copy back (hand-computed small graphs); the executor with
copies that finish late (`late_copies`, a stand-in for a GPU's copy streams) trains like plain PyTorch and counts,
on the CPU, the peak that a plan made for a GPU predicts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn

from ucudnn.devices import DeviceProfile, load_profile
from ucudnn.memory.graph import Op, TrainingGraph
from ucudnn.memory.planner import as_executed, make_plan
from ucudnn.memory.simulate import StepCost, simulate
from ucudnn.torch import execute_plan, plan_memory
from ucudnn.torch.checking.check import check_plan
from ucudnn.torch.running.offload import _LateCopier, late_copies
from ucudnn.torch.running.prepared_plan import _prepared

sys.path.insert(0, str(Path(__file__).parent))
import itertools

from plain_training import assert_trains_alike, train
from test_torch_memory import HAND_PLANS, SmallNet, TwoHeads, _both_heads_loss, _data, _hand_plan

MB = 10**6  # a feature map of (1, 250000) float32
# 1 MB copies in 1 ms each way; the slow one copies out at 0.5 GB/s (2 ms)
FAST = DeviceProfile(
    "toy",
    "toy",
    10**9,
    h2d_gbps=1.0,
    d2h_gbps=1.0,
    duplex_gbps=2.0,
    devices_per_link=1,
    fp32_tflops=1.0,
    memory_gbps=1.0,
)
SLOW_OUT = DeviceProfile(
    "slow-out",
    "slow-out",
    10**9,
    h2d_gbps=1.0,
    d2h_gbps=0.5,
    duplex_gbps=2.0,
    devices_per_link=1,
    fp32_tflops=1.0,
    memory_gbps=1.0,
)


def chain(layers: int) -> TrainingGraph:
    """x -> l1 -> ... -> loss: each linear layer reads and saves the map before it, the loss the last one."""
    shape = (1, 250_000)
    names = ["x", *(f"l{i}" for i in range(1, layers + 1))]
    ops = [Op("x", "input", (), shape)]
    ops += [Op(n, "linear", (prev,), shape, saves=(prev,), weight_bytes=4) for prev, n in itertools.pairwise(names)]
    return TrainingGraph(f"chain{layers}", 1, (*ops, Op("loss", "loss", (names[-1],), (1,), saves=(names[-1],))))


def lives(result, names):
    """(time, storage, +bytes or -bytes) of `names` in the allocation trace."""
    return [(round(t, 9), n, b) for t, n, b in result.devices[0].allocations if n in names]


def test_an_offloaded_map_is_held_until_its_copy_out_ends():
    # steps: fwd x, l1, l2, loss (0-3); bwd loss, l2, l1 (4-6). l1 is made 0->2 ms and copied out at 0.5 GB/s,
    # 2->4; l2's forward, its last reader, ends at 3, but l1's memory goes at 4, when its copy has ended (the
    # step after waits for it: 4->6). It comes back at the model's first backward step (6): allocated then,
    # copied 6->7, read by l2's backward 7->11 and freed after it.
    costs = [StepCost(0), StepCost(2), StepCost(1), StepCost(2), StepCost(0), StepCost(4), StepCost(4)]
    r = simulate(chain(2), SLOW_OUT, costs, {"l1": "offload"}, prefetch="ahead")
    assert lives(r, {"l1"}) == [(0.0, "l1", MB), (4.0, "l1", -MB), (6.0, "l1", MB), (11.0, "l1", -MB)]
    assert [(i.start_ms, i.end_ms) for i in r.timeline if i.stream == "d2h"] == [(2.0, 4.0)]
    assert r.step_ms == pytest.approx(15.0)


def test_prefetched_maps_are_held_from_their_issue_one_map_ahead():
    # steps: fwd x, l1, l2, l3, loss (0-4); bwd loss, l3, l2, l1 (5-8), each 2 ms forward, 4 ms backward;
    # x, l1 and l2 offloaded (out 0->1, 2->3, 4->5; freed at 2, 4, 6 after their last readers).
    # The executor looks at the model's first backward step (l3's, at 6 ms): it issues l2, which that step
    # reads, and one map ahead, l1: both allocated at 6, though l1's copy back waits for l2's (6->7, 7->8).
    # l3's backward runs 7->11; at l2's backward (11) it issues x, one ahead again (copied 11->12); l2's
    # backward reads l1, there since 8: 11->15; l1's backward reads x: 15->19.
    costs = [
        StepCost(0),
        StepCost(2),
        StepCost(2),
        StepCost(2),
        StepCost(0),
        StepCost(0),
        StepCost(4),
        StepCost(4),
        StepCost(4),
    ]
    offload = {"x": "offload", "l1": "offload", "l2": "offload"}
    r = simulate(chain(3), FAST, costs, offload, prefetch="ahead")
    back = [(t, n) for t, n, b in lives(r, set(offload)) if b > 0 and t >= 6]
    assert back == [(6.0, "l2"), (6.0, "l1"), (11.0, "x")]
    assert [(i.label, round(i.start_ms, 9), round(i.end_ms, 9)) for i in r.timeline if i.stream == "h2d"] == [
        ("l2", 6.0, 7.0),
        ("l1", 7.0, 8.0),
        ("x", 11.0, 12.0),
    ]
    assert r.step_ms == pytest.approx(19.0) and r.stall_ms == pytest.approx(1.0)
    # a policy's own trigger at the same step holds l1's memory only from its copy's start
    at_start = simulate(chain(3), FAST, costs, offload, prefetch={"l2": 6, "l1": 6, "x": 7})
    assert [(t, n) for t, n, b in lives(at_start, set(offload)) if b > 0 and t >= 6] == [
        (6.0, "l2"),
        (7.0, "l1"),
        (11.0, "x"),
    ]


def test_the_executor_issues_its_copies_back_as_the_simulator_times_them():
    # the same three-layer chain in PyTorch: what the executor does, in order, is what the simulator's
    # "ahead" trigger assumed above (l2 and l1 before l3's backward unpacks l2, x before l2's unpacks l1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    x_, l1, l2 = "input", "0:addmm", "1:addmm"  # saved by the next layers
    plan = _hand_plan(model, x, {x_: "offload", l1: "offload", l2: "offload"}, loss=lambda out: out.sum())
    with late_copies(), execute_plan(model, plan) as stats:
        model(x).sum().backward()
    assert [e for e in stats.events if e[0] != "offload"] == [
        ("prefetch", l2),
        ("prefetch", l1),
        ("unpack", l2),
        ("prefetch", x_),
        ("unpack", l1),
        ("unpack", x_),
    ]


def test_a_late_copy_is_made_when_something_waits_for_it():
    copier = _LateCopier()
    t = torch.randn(3, 5)
    host = torch.zeros(3, 5)
    out = copier.to_host(t, host, None)
    assert not host.any()  # in flight: the host buffer is not written yet
    dev, back = copier.to_device(host, t.device, out)
    assert dev.shape == t.shape  # allocated at issue, as on a GPU
    copier.wait(back, t.device)  # the copy back waits for the copy out
    assert torch.equal(host, t) and torch.equal(dev, t)
    assert out.run is None and back.run is None  # done: the copies hold their tensors no longer


class RootReads(nn.Module):
    """conv1's output is saved by conv2, which reads it last in the model's own forward (no module call ends
    there), and the next operation, a scaling, allocates and saves nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (nn.Parameter(torch.randn(8, c, 3, 3) * 0.1) for c in (3, 8, 8))

    def forward(self, x):
        x = nn.functional.conv2d(x, self.w1, padding=1)
        x = nn.functional.conv2d(x, self.w2, padding=1)
        x = x * 2.0
        x = nn.functional.conv2d(x, self.w3, padding=1)
        return x.mean((2, 3))


def test_late_copies_hold_an_offloaded_map_until_the_executor_lets_it_go():
    # On a GPU the executor holds an offloaded map's device tensor until its copy may still run, and lets it go
    # at the next save or scoped module call's end after its last reader: here conv3's save, after the scaling
    # has allocated its output. With prompt copies the CPU frees it when the forward drops it, before the
    # scaling; with late ones after it: the two events change places, and nothing else changes.
    torch.manual_seed(0)
    model = RootReads()
    x = torch.randn(4, 3, 16, 16)

    def loss(out):
        return out.square().sum()

    plan = _hand_plan(model, x, {"conv": "offload"}, loss=loss)
    prompt = check_plan(model, plan, x, loss=loss, steps=1).tracker.memory
    with late_copies():
        late = check_plan(model, plan, x, loss=loss, steps=1).tracker.memory
    assert len(prompt) == len(late)
    ((i, a, b),) = [(i, a, b) for i, ((_, a), (_, b)) in enumerate(zip(prompt, late)) if a != b]
    held = prompt[i - 1][1]  # conv1's and conv2's outputs and what came before
    one_map = 4 * 8 * 16 * 16 * 4
    assert (a, b) == (held - one_map, held + one_map)


@pytest.mark.parametrize("name", ["offload-all", "mixed"])
def test_late_copies_train_like_plain_pytorch(name):
    def batch(step):
        return _data(seed=step)

    torch.manual_seed(0)
    reference = train(SmallNet(), batch)
    torch.manual_seed(0)
    noise = (reference - train(SmallNet(), batch, threads=2)).norm().item()
    torch.manual_seed(0)
    model = SmallNet()
    plan = _hand_plan(model, _data()[0], HAND_PLANS[name])
    with late_copies():
        trained = train(model, batch, plan)
    assert (torch.device("cpu"), "late") in _prepared(model, plan).copies
    assert_trains_alike(trained, reference, noise)


@pytest.mark.parametrize("policy", ["vdnn-all", "dymem"])
def test_a_late_copy_run_counts_the_peak_a_gpu_plan_predicts(policy):
    # a plan for an H100 at a 1-byte limit: an offloading policy's must offload (optimal's is the smallest plan,
    # which recomputes here). Its step, run on CPU tensors with copies that finish late, counted by StepTracker:
    # the device's peak is the plan's within 5%
    torch.manual_seed(0)
    model = SmallNet()
    x, y = _data(n=8)
    plan = plan_memory(
        model, x, memory_limit=1, policy=policy, device="h100", loss=lambda out: nn.functional.cross_entropy(out, y)
    )
    assert any(t.action == "offload" for t in plan.tensors)
    with late_copies():
        checked = check_plan(model, plan, x, y, steps=1)
    assert (torch.device("cpu"), "late") in _prepared(model, plan).copies
    assert checked.bytes_moved > 0
    assert 0.95 <= checked.peak_ratio <= 1.05, (checked.peak_bytes, plan.peak_bytes)


def test_a_plan_that_fits_only_by_its_policys_copy_timing_is_made_again_within_a_lower_limit():
    # halfway between TwoHeads' largest and smallest peaks on a K40, optimal offloads one map and fits by its
    # own prefetch trigger; issued by the executor's rule (at the model's first backward step) that map is
    # back before the peak and the plan does not fit. plan_memory plans again lower: a plan that fits as run.
    torch.manual_seed(0)
    x, y = _data()

    def loss(out):
        return _both_heads_loss(out, y)

    peaks = [
        plan_memory(TwoHeads(), x, memory_limit=limit, policy="optimal", device="k40", loss=loss).peak_bytes
        for limit in (2**40, 1)
    ]
    limit = sum(peaks) // 2
    model = TwoHeads()
    plan = plan_memory(model, x, memory_limit=limit, policy="optimal", device="k40", loss=loss)
    graph = plan.capture.graph
    own = make_plan(graph, "k40", limit, "optimal")
    assert own.fits and any(t.action == "offload" for t in own.tensors)
    assert not as_executed(own, graph, load_profile("k40")).fits
    assert plan.fits and plan.memory_limit == limit and plan.peak_bytes <= limit
    with late_copies():
        checked = check_plan(model, plan, x, loss=loss, steps=1)
    assert checked.peak_bytes <= limit and 0.95 <= checked.peak_ratio <= 1.05


def test_optimals_prefetch_comes_no_later_than_a_rebuild_that_reads_the_map():
    # steps: fwd x, l1, l2, l3, loss (0-4); bwd loss, l3, l2, l1 (5-8). l2 is recomputed from l1 before l3's
    # backward: the expanded schedule is ..., loss bwd (5), l2 again (6), l3 bwd (7), l2 bwd (8), l1 bwd (9).
    # The program's row for l1's copy back is l2's backward (graph step 7, position 8); the rebuild at 6 reads l1
    # first, so the copy back starts there (a trigger after its use was refused, and HF RegNet's plans with it).
    from ucudnn.memory.optimal import _triggers

    graph = chain(3)
    actions = {"l1": "offload", "l2": "recompute"}
    assert _triggers(graph, actions, {"l1": 7}) == {"l1": 6}
    costs = [StepCost(1)] * len(graph.steps)
    assert simulate(graph, FAST, costs, actions, prefetch=_triggers(graph, actions, {"l1": 7})).bytes_prefetched == MB
