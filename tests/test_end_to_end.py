"""One model, end to end, as a user writes it: convert, plan_memory, execute_plan, train.

Each model shape of `ucudnn.torch.zoo` is converted (its convolutions through a ucudnn handle),
planned under every policy on the CPU, and trained three SGD steps under each plan; its
parameters and batch-norm statistics must equal plain PyTorch's after the same steps. The plans
are the converted layers' own (their handle measured the budgets, on stand-in timings: see
`TimedByWorkspace`), offload nothing on a CPU (a copy to the host would land in the same memory),
and the orders a user may write either work or are refused in one line saying what to do.

In float64: three steps of a small-batch network amplify float32 rounding into percent-sized
differences (a 1e-7 relative nudge of the weights moves plain PyTorch's own parameters by up to 15%
at these sizes in float32), so that equality would say nothing; in float64 every algorithm must agree to 1e-7.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from ucudnn.solver.types import Infeasible

from ucudnn.backends.cpu import CpuBackend
from ucudnn.memory.planner import OFFLOADING, POLICIES
from ucudnn.torch import Conv2d, convert, execute_plan, plan_memory, zoo

STEPS = 3
# input size per model: CPU-sized, and large enough that batch norm over the last stage is well
# conditioned (ResNet-50 at 32 px normalises 4 values per channel there: a 1e-12 nudge grows to 1e-2)
SHAPES = {"resnet18": 32, "resnet50": 64, "vgg16": 32, "densenet": 32}
# where feature maps, not weights, make the peak at these sizes: recomputing lowers it
RECOMPUTING = ("resnet50", "densenet")


class TimedByWorkspace(CpuBackend):
    """The CPU backend with stand-in timings: every kernel still runs and is verified, but a measurement reads
    0.01 ms plus 1 ms per MiB of the workspace the algorithm declares (torch's own convolution's estimate
    included), not the wall clock. So each kernel's fastest option is its smallest on every run, however loaded
    the machine: the policies' peaks compared below count the same maps, weights and workspaces each time. (On
    measured times, which kernels win, and so what workspace the fastest options hold, is a race: the smallest
    peak of checkpoint, which keeps the fastest options, came out over vdnn-dyn's, which keeps the smallest.)"""

    def time_run_ms(self, problem, algo, operands, workspace, reps, beta=0.0):
        return [0.01 + self.workspace_size(problem, algo) / 2**20] * reps


def _data(size, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, size, size, generator=g, dtype=torch.float64), torch.randint(0, 10, (4,), generator=g)


def _train(model, size, plan=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    for step in range(STEPS):
        x, y = _data(size, step)
        opt.zero_grad()
        if plan is None:
            F.cross_entropy(model(x), y).backward()
        else:
            with execute_plan(model, plan):
                F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def _assert_same(ref, got):
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-7, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Per model, made once: the model, plain training's result, and one measurement cache for all
    its policies (as a user's cache would be: each policy's handle reads what the first measured)."""
    made = {}

    def get(name):
        if name not in made:
            torch.manual_seed(0)
            plain = zoo.build(name, num_classes=10).double()
            made[name] = (
                plain,
                _train(copy.deepcopy(plain), SHAPES[name]),
                f"sqlite:///{tmp_path_factory.mktemp(name)}/cache.db",
            )
        return made[name]

    return get


# ResNet-50 under every policy but optimal takes about a minute each on 2 cores: behind -m slow
CASES = [
    pytest.param(name, policy, marks=[pytest.mark.slow] if name == "resnet50" and policy != "optimal" else [])
    for name in SHAPES
    for policy in POLICIES
]


@pytest.mark.parametrize("name, policy", CASES)
def test_converted_planned_and_executed_trains_like_plain_pytorch(trained, name, policy):
    """At a limit halfway between the policy's smallest peak and keeping everything: the offloading policies,
    which cannot offload into the CPU's own memory, plan as vdnn-dyn. Checkpoint and optimal, where feature
    maps make the peak, at a limit below the smallest peak that keeps every map (vdnn-dyn's smallest here):
    they recompute. The kernels' times are stand-ins (`TimedByWorkspace`) and no per-call charge is added (the
    charge `convert` measures, `route_overhead_ms`, is a real timing too), so each kernel's front is its
    smallest option alone and every peak here is the same on every run."""
    plain, reference, db = trained(name)
    size = SHAPES[name]
    # NumPy on one thread, as convert's own CPU handles run it
    model = convert(
        copy.deepcopy(plain),
        backend=TimedByWorkspace(numpy_threads=1),
        workspace_limit=64 * 2**20,
        policy="undivided",
        reps=1,
        db=db,
        call_overhead=0,
    )
    x, y = _data(size, 0)
    loss = lambda out: F.cross_entropy(out, y)
    peaks = [plan_memory(model, x, memory_limit=limit, policy=policy, loss=loss).peak_bytes for limit in (2**40, 1)]
    limit = sum(peaks) // 2
    if policy not in OFFLOADING and name in RECOMPUTING:
        every_map = plan_memory(model, x, memory_limit=1, policy="vdnn-dyn", loss=loss).peak_bytes
        assert peaks[1] < every_map
        limit = min(limit, (peaks[1] + every_map) // 2)
    plan = plan_memory(model, x, memory_limit=limit, policy=policy, loss=loss)
    assert plan.fits and plan.conv_workspace and all(c.bytes <= 64 * 2**20 for c in plan.conv_workspace)
    assert not [t.name for t in plan.tensors if t.action == "offload"]  # a CPU plan offloads nothing
    if policy in OFFLOADING:
        assert plan.tensors == plan_memory(model, x, memory_limit=limit, policy="vdnn-dyn", loss=loss).tensors
    elif name in RECOMPUTING:
        assert any(t.action == "recompute" for t in plan.tensors)
    else:  # the peak is the weights and their gradients at the backward pass's end: few feature maps to drop
        # (the no-limit peak adds the fastest kernels' workspaces)
        assert peaks[1] <= peaks[0] and 2 * plan.capture.graph.weight_bytes > 0.9 * peaks[1]
    _assert_same(reference, _train(model, size, plan))


def test_a_plan_made_before_convert_is_refused_in_one_line_when_its_budgets_fit_nothing():
    torch.manual_seed(0)
    plain = zoo.build("resnet18", num_classes=10).double()
    x = _data(32, 0)[0]
    loss = lambda out: F.cross_entropy(out, _data(32, 0)[1])
    plan = plan_memory(plain, x, policy="checkpoint", loss=loss)  # no handle yet: torch's own convolution
    assert all(c.bytes == 0 for c in plan.conv_workspace)
    model = convert(plain, backend="cpu", policy="undivided", algos=["native", "im2col_gemm"], reps=1, db="sqlite://")
    with pytest.raises(Infeasible) as caught:
        _train(model, 32, plan)
    message = str(caught.value)
    assert "\n" not in message and "plan_memory on the converted model" in message
    # the order that works: plan the converted model
    _train(model, 32, plan_memory(model, x, policy="checkpoint", loss=loss))


def test_wd_handles_plan_and_train_from_the_first_step():
    torch.manual_seed(0)
    plain = zoo.build("resnet18", num_classes=10).double()
    reference = _train(copy.deepcopy(plain), 32)
    model = convert(
        copy.deepcopy(plain), backend="cpu", total_workspace=64 * 2**20, policy="undivided", reps=1, db="sqlite://"
    )
    x, y = _data(32, 0)
    plan = plan_memory(model, x, policy="optimal", loss=lambda out: F.cross_entropy(out, y))
    handle = next(m.handle for m in model.modules() if isinstance(m, Conv2d))
    assert handle.mode == "WD"
    _assert_same(reference, _train(model, 32, plan))
