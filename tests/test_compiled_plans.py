"""Memory plans inside torch.compile (`plan_memory(..., compiled=True)`, `with_plan`): the plan's decisions reach
the compiled graph's partitioner, a compiled planned step's counted peak is the predicted one's, it trains as
plain compiled training does, and what a compiled step cannot do is refused in one line.

Most compiles trace only (AOTAutograd with Inductor's own decompositions and partitioner, `compiled_step._graphs`,
no code generation); one test compiles with Inductor itself (about a minute on 2 cores)."""

from __future__ import annotations

import copy
import dataclasses

import pytest

torch = pytest.importorskip("torch")
from plain_training import assert_trains_alike, rounding_noise, train
from torch import nn
from torch.nn import functional as F

from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.handle import native_only
from ucudnn.memory.plan import ConvWorkspace, MemoryPlan
from ucudnn.torch import StepTracker, convert, plan_memory, with_plan
from ucudnn.torch.converting.layer import ConvLayer, PlanBudgets
from ucudnn.torch.planning import compiled_step
from ucudnn.torch.planning import planner as planner_module

BATCH, SIZE = 4, 16


class Net(nn.Module):
    """Three conv + batch-norm + ReLU layers, an instance-normalised one (eager PyTorch runs it as a batch-norm;
    a compiler's trace as another operation and a copy), a classifier."""

    def __init__(self, extra: bool = True) -> None:
        super().__init__()
        self.extra = extra
        self.body = nn.Sequential(
            *(
                m
                for i, o in ((3, 16), (16, 16), (16, 16))
                for m in (nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())
            )
        )
        self.conv = nn.Conv2d(16, 16, 3, padding=1)
        self.norm = nn.InstanceNorm2d(16, affine=True)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.body(x)
        if self.extra:
            x = F.relu(self.norm(self.conv(x)))
        return self.head(x.mean((2, 3)))


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 3, SIZE, SIZE, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


X, Y = _batch(0)


def _loss(out):
    return F.cross_entropy(out, Y)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Net()


@pytest.fixture(scope="module")
def plans(model):
    """A compiled plan that keeps what it may, and the compiled plan at a limit below every plan (the one of least
    compiled peak among those tried)."""
    everything = plan_memory(model, X, loss=_loss, compiled=True)
    smallest = plan_memory(model, X, memory_limit=1, loss=_loss, compiled=True)
    return everything, smallest


def _saved_bytes(forward) -> int:
    """The bytes of the activations a forward graph saves for the backward pass (its outputs that are not its
    inputs, each storage once)."""
    sizes = {}
    for node in forward.graph.find_nodes(op="output")[0].all_input_nodes:
        if node.op == "placeholder":  # a parameter or input saved as it is: resident anyway
            continue
        value = node.meta.get("val")
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor):
                sizes[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(sizes.values())


def _saved_and_recomputed(model, plan) -> tuple[int, int]:
    """(bytes the compiled forward graph saves for the backward pass, convolutions the backward graph runs
    forward again) under `plan`, traced as Inductor would compile it."""
    planned = with_plan(copy.deepcopy(model), plan)
    graphs = compiled_step._graphs(planned, lambda m: _loss(m(X)).backward())
    forward, backward = graphs[False][0], graphs[True][0]
    convs = sum(1 for n in backward.graph.nodes if n.target is torch.ops.aten.convolution.default)
    return _saved_bytes(forward), convs


def test_a_compiled_plan_keeps_or_recomputes_and_says_it_was_planned_compiled(plans):
    smallest = plans[1]
    for plan in plans:
        assert plan.compiled and plan.capture is not None
        assert {t.action for t in plan.tensors} <= {"keep", "recompute", "release"}
        assert MemoryPlan.from_json(plan.to_json()).compiled
    assert any(t.action == "recompute" for t in smallest.tensors)
    assert "compiled" not in plan_memory(Net(), X, loss=_loss, device="h100").to_json()


def test_the_partitioner_saves_what_the_plan_keeps_and_recomputes_the_rest(model, plans):
    """A plan that recomputes convolutions (checkpointing's at the least memory, which offloads nothing; compiled
    plans rarely do: recomputing a convolution does not lower this model's compiled peak): the backward graph runs
    them again, and the forward graph saves fewer bytes than under the plan that keeps what it may."""
    everything = plans[0]
    smallest = plan_memory(model, X, memory_limit=1, policy="checkpoint", device="h100", loss=_loss)
    kept_saved, kept_convs = _saved_and_recomputed(model, everything)
    small_saved, small_convs = _saved_and_recomputed(model, smallest)
    recomputed_convs = sum(
        t.action == "recompute" and everything.capture.graph.op(t.name).conv is not None
        for t in smallest.tensors
        if t.name in everything.capture.graph.op_index
    )
    assert recomputed_convs > 0
    assert kept_convs == 0
    assert small_convs >= recomputed_convs
    assert small_saved < kept_saved


def test_a_limit_the_plan_keeping_what_it_may_fits_gets_that_plan_without_tracing_it_again(model, plans, monkeypatch):
    """The plan that keeps what it may is the fastest, so it is tried first; at a limit it fits, it is the plan,
    and its peak, traced for an earlier limit of the same model, is not traced again."""
    traced = []
    trace = compiled_step.compiled_peak
    monkeypatch.setattr(compiled_step, "compiled_peak", lambda *args: traced.append(args) or trace(*args))
    everything = plans[0]
    plan = plan_memory(model, X, memory_limit=everything.peak_bytes, loss=_loss, compiled=True)
    assert plan.fits and plan.peak_bytes == everything.peak_bytes
    assert [(t.name, t.action) for t in plan.tensors] == [(t.name, t.action) for t in everything.tensors]
    assert traced == []


def test_a_compiled_plan_neither_measures_nor_charges_the_eager_executors_replay(monkeypatch):
    """Compiled, a recomputation runs inside the backward graph's own code, where the eager executor replays each
    operation from Python: planning on this CPU for a compiled step neither measures that host time nor charges it
    (every solve's graph holds none). An eager plan of the same model afterwards measures it and plans with it."""
    from ucudnn.memory import planner

    measured, graphs = [], []
    replay_host_ms = planner_module.replay_host_ms
    monkeypatch.setattr(
        planner_module, "replay_host_ms", lambda *a: measured.append(replay_host_ms(*a)) or measured[-1]
    )
    solve = planner.make_executed_plan
    monkeypatch.setattr(planner, "make_executed_plan", lambda g, *a, **k: graphs.append(g) or solve(g, *a, **k))
    torch.manual_seed(0)
    model = Net()
    plan_memory(model, X, loss=_loss, compiled=True)  # (no device: timed on this CPU)
    assert graphs and all(g.replay_host_ms == 0.0 for g in graphs) and measured == []
    plan_memory(model, X, memory_limit=1, loss=_loss)
    assert len(measured) == 1 and graphs[-1].replay_host_ms == measured[0]


def test_a_trace_collects_only_its_own_garbage_and_leaves_the_collector_as_it_found_it(model, plans, monkeypatch):
    """During a trace the garbage collector skips the objects alive before it (frozen), and after it they are
    collected again; where the caller froze objects itself, they stay frozen."""
    import gc

    frozen_during = []
    graphs = compiled_step._graphs
    monkeypatch.setattr(compiled_step, "_graphs", lambda *a: frozen_during.append(gc.get_freeze_count()) or graphs(*a))
    assert gc.get_freeze_count() == 0
    peak = compiled_step.compiled_peak(model, plans[0], (X,), {}, _loss)
    assert frozen_during[0] > 0 and gc.get_freeze_count() == 0
    gc.freeze()  # the caller's
    try:
        theirs = gc.get_freeze_count()
        assert compiled_step.compiled_peak(model, plans[0], (X,), {}, _loss) == peak
        assert frozen_during[1] == theirs and gc.get_freeze_count() > 0  # (theirs, less what died since)
    finally:
        gc.unfreeze()


def _spied_search(monkeypatch) -> dict[str, list]:
    """What `compiled_plan` asks of its three callables, as it asks: each target with the eager plan made for it
    (``asked``: target, its modelled peak), each plan as the compiled step takes it whole (`recompute_fused`, either
    way) with the eager model's peak of it (``made``, ``taken``), each partial way (``partial``), and each plan
    traced with its peak (``traced_plans``, ``traced``)."""
    seen: dict[str, list] = {"asked": [], "made": [], "taken": [], "partial": [], "traced_plans": [], "traced": []}
    search = planner_module.compiled_plan

    def spied(step, graph, limit, make, modelled_peak, peak_of):
        whole: list[tuple] = []  # the decisions of the last eager plan taken whole, either way

        def made(target):
            plan = make(target)
            seen["asked"].append((target, plan.peak_bytes))
            ways = (compiled_step.recompute_fused(plan, graph, rerunning) for rerunning in (False, True))
            whole[:] = [compiled_step._decisions(way) for way in ways]
            return plan

        def eager(plan):
            taken = modelled_peak(plan)
            if compiled_step._decisions(plan) not in whole:
                seen["partial"].append(plan)
                return taken
            seen["made"].append(plan)
            seen["taken"].append(taken)
            return taken

        def peak(plan):
            seen["traced_plans"].append(plan)
            seen["traced"].append(peak_of(plan))
            return seen["traced"][-1]

        return search(step, graph, limit, made, eager, peak)

    monkeypatch.setattr(planner_module, "compiled_plan", spied)
    return seen


def _traced_only_below_the_last_traced(search: dict[str, list]) -> None:
    """Each plan asked, taken whole, was traced where, and only where, the eager model's peak of its decisions as the
    compiled step takes them lay below the last traced plan's (the first plan is always traced)."""
    traced = [any(p is q for q in search["traced_plans"]) for p in search["made"]]
    last = None
    for i, taken in enumerate(search["taken"]):
        assert traced[i] == (last is None or taken < last), i
        last = taken if traced[i] else last


def test_below_the_fastest_plan_the_target_is_a_modelled_peak_less_a_traced_overflow_tracing_only_smaller_plans(
    model, monkeypatch
):
    """A limit just below the compiled peak of the plan that keeps what it may (on the H100 profile's times, so that
    no timing here decides the plans): the eager planner is asked next for a plan within that plan's modelled (eager)
    peak lowered by the compiled overflow, not within the limit. The plans the eager model, taking their decisions
    as the compiled step does, finds no smaller than the fastest (the second and third asked: they differ from it
    only in maps that fused operations make, which the compiled step recomputes anyway) are not traced: the target
    goes on down by the fastest plan's overflow, to a plan that recomputes a convolution, whose compiled step fits."""
    fastest = plan_memory(model, X, loss=_loss, compiled=True, device="h100")
    search = _spied_search(monkeypatch)
    limit = fastest.peak_bytes - 1
    plan = plan_memory(copy.deepcopy(model), X, memory_limit=limit, loss=_loss, compiled=True, device="h100")
    asked, traced = search["asked"], search["traced"]
    assert traced[0] == fastest.peak_bytes and len(asked) > len(traced) == 2  # (asks not traced between)
    _traced_only_below_the_last_traced(search)
    for i in range(len(asked) - 1):  # each target after the first: the last plan's modelled peak less the overflow
        assert asked[i + 1][0] == max(1, asked[i][1] - (traced[0] - limit))
    assert plan.fits and plan.peak_bytes == traced[1] <= limit
    assert any(t.action == "recompute" and t.name.endswith(":conv") for t in plan.tensors)


def test_the_search_stops_where_a_traced_peak_does_not_fall(model, monkeypatch):
    """The same limit, with a compiled step whose peak stays the fastest plan's however much the plan recomputes (a
    recomputed chain living from the backward graph's start can do that): after the second trace, no lower target
    is asked (each further plan would cost a trace and find nothing), and the plan of least peak, the first traced,
    is the answer."""
    fastest = plan_memory(model, X, loss=_loss, compiled=True, device="h100")
    search = planner_module.compiled_plan
    asked, traced = [], []

    def flat(step, graph, limit, make, modelled_peak, peak_of):
        def made(target):
            asked.append(target)
            return make(target)

        def peak(plan):
            traced.append(len(asked))
            return fastest.peak_bytes

        return search(step, graph, limit, made, modelled_peak, peak)

    monkeypatch.setattr(planner_module, "compiled_plan", flat)
    limit = fastest.peak_bytes - 1
    plan = plan_memory(copy.deepcopy(model), X, memory_limit=limit, loss=_loss, compiled=True, device="h100")
    assert len(traced) == 2 and traced[-1] == len(asked)  # (stopped at the second trace, asking nothing more)
    assert not plan.fits and plan.tensors == fastest.tensors


def test_a_plan_the_eager_model_finds_larger_as_the_compiled_step_takes_it_is_not_traced(monkeypatch):
    """transformers' ResNet (basic blocks, depths 2, 2) at 0.8 of its fastest plan's compiled peak, on the H100
    profile's times. Each plan asked is taken two ways: with the maps fused ops make from what it keeps
    recomputed, then with every fused map recomputed, convolutions rerun where they must be. The second plan asked
    recomputes convolutions: taken the first way the eager model finds it smaller than the fastest, so it is traced,
    and its compiled peak is lower; taken the second way it finds it larger, so it is not traced (a trace costs most
    of a compile), and traced anyway its compiled peak is no lower. The target goes on down until the eager planner
    goes no lower; the plan is the one of least peak."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ResNetConfig(
        depths=[2, 2], hidden_sizes=[8, 16], embedding_size=8, layer_type="basic", num_labels=10
    )
    resnet = transformers.ResNetForImageClassification(config)
    x = torch.randn(BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(1))

    def labelled(out):
        return F.cross_entropy(out.logits, Y)

    fastest = plan_memory(resnet, x, loss=labelled, compiled=True, device="h100")
    search = _spied_search(monkeypatch)
    plan = plan_memory(
        resnet, x, memory_limit=int(0.8 * fastest.peak_bytes), loss=labelled, compiled=True, device="h100"
    )
    asked, made, taken, traced = search["asked"], search["made"], search["taken"], search["traced"]
    _traced_only_below_the_last_traced(search)
    assert traced[0] == fastest.peak_bytes and len(traced) == 2 and traced[1] < traced[0]
    # the second plan asked: taken the first way, traced; the second way (made next, more recomputed), not
    i = next(i for i, p in enumerate(made) if p is search["traced_plans"][1])
    second, rerunning = made[i], made[i + 1]
    recomputed = [{t.name for t in p.tensors if t.action == "recompute"} for p in (second, rerunning)]
    assert recomputed[1] > recomputed[0] and taken[i + 1] > taken[0]
    assert all(p is not rerunning for p in search["traced_plans"])
    convs = [{t.name for t in p.tensors if t.action == "recompute" and t.name.endswith(":conv")} for p in made]
    assert not convs[0] and convs[i]  # (the second plan recomputes convolutions)
    assert asked[-1][1] == asked[-2][1]  # (stopped where the eager planner went no lower)
    assert not plan.fits and plan.peak_bytes == traced[1]
    untraced = compiled_step.compiled_peak(resnet, rerunning, (x,), {}, labelled)
    assert untraced >= traced[1]


class ResidualUnit(nn.Module):
    """MONAI's residual unit in small: a strided convolution, normalised and activated, plus a strided convolution
    of the input (its output read by nothing but the sum); the next convolution reads the sum; a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16)
        self.skip = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.next = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        y = F.relu(self.norm(self.conv(x))) + self.skip(x)
        return self.head(self.next(y).mean((2, 3)))


def test_a_sum_of_a_dropped_convolution_output_is_kept_so_that_no_convolution_runs_again():
    """The fastest compiled plan keeps the residual sum: recomputing it (free, fused) would rerun the skip
    convolution, whose output the plan drops. Taken with every fused map recomputed, the backward graph runs that
    convolution again."""
    torch.manual_seed(0)
    unit = ResidualUnit()
    plan = plan_memory(unit, X, loss=_loss, compiled=True, device="h100")
    actions = {t.name: t.action for t in plan.tensors}
    assert actions["add"] == "keep" and actions["skip:conv"] == "release" and actions["relu"] == "recompute"
    assert _saved_and_recomputed(unit, plan)[1] == 0
    rerunning = compiled_step.recompute_fused(plan, plan.capture.graph, rerunning_convs=True)
    assert next(t.action for t in rerunning.tensors if t.name == "add") == "recompute"
    assert _saved_and_recomputed(unit, rerunning)[1] > 0


def test_a_plan_that_misses_by_little_reruns_the_fewest_convolutions_the_eager_model_finds_enough(monkeypatch):
    """MONAI's 2-D UNet in small, on the H100 profile's times: the plan that reruns no convolution (its residual
    sums kept) misses a limit just below its compiled peak. Taken with every such sum recomputed, it would rerun a
    strided convolution per sum; the plan taken recomputes the one sum the eager model finds lowest alone, fits
    (its second trace), and reruns one convolution."""
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    unet = nets.UNet(
        spatial_dims=2, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2), num_res_units=2
    )
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 1, 32, 32, generator=g), torch.randint(0, 2, (2, 32, 32), generator=g)

    def segmented(out):
        return F.cross_entropy(out, y)

    fastest = plan_memory(unet, x, loss=segmented, compiled=True, device="h100")
    search = _spied_search(monkeypatch)
    plan = plan_memory(unet, x, memory_limit=fastest.peak_bytes - 1, loss=segmented, compiled=True, device="h100")
    _traced_only_below_the_last_traced(search)
    assert search["traced"][0] == fastest.peak_bytes and len(search["traced"]) == 2
    assert plan.fits and plan.peak_bytes == search["traced"][1] and plan is not fastest
    free = search["made"][0]
    rerunning = compiled_step.recompute_fused(free, plan.capture.graph, rerunning_convs=True)
    recomputed = [{t.name for t in p.tensors if t.action == "recompute"} for p in (free, plan, rerunning)]
    assert recomputed[0] < recomputed[1] < recomputed[2] and len(recomputed[1] - recomputed[0]) == 1

    def convolutions_rerun(p):
        graphs = compiled_step._graphs(with_plan(copy.deepcopy(unet), p), lambda m: segmented(m(x)).backward())
        return sum(1 for n in graphs[True][0].graph.nodes if n.target is torch.ops.aten.convolution.default)

    assert convolutions_rerun(free) == 0 and convolutions_rerun(plan) == 1 < convolutions_rerun(rerunning)


def test_an_offloading_plan_is_refused_compiled_in_one_line_naming_the_policy_that_would_carry_it(model):
    """Eagerly the module offloads (tests/test_planned_module.py); a compiled step cannot."""
    offloading = plan_memory(model, X, memory_limit=1, loss=_loss, device="h100")
    assert any(t.action == "offload" for t in offloading.tensors)
    torch._dynamo.reset()
    with pytest.raises(UnsupportedProblem, match="MUST_CPU_OFFLOAD") as info:
        torch.compile(with_plan(copy.deepcopy(model), offloading), backend="eager")(X)
    assert "\n" not in str(info.value) and "compiled=True" in str(info.value)
    compiled = plan_memory(model, X, memory_limit=1, loss=_loss, device="h100", compiled=True)
    assert "offload" not in {t.action for t in compiled.tensors}


def test_a_plan_without_its_captured_step_is_refused(plans, model):
    with pytest.raises(InvalidInput, match="plan again"):
        with_plan(model, MemoryPlan.from_json(plans[1].to_json()))


def test_an_eager_plan_without_offloads_runs_under_with_plan(model):
    plan = plan_memory(model, X, memory_limit=1, loss=_loss)
    assert "offload" not in {t.action for t in plan.tensors}  # (on a CPU: nothing to offload to)
    planned = copy.deepcopy(model)
    _loss(with_plan(planned, plan)(X)).backward()
    assert all(p.grad is not None for p in planned.parameters())


def test_with_plan_called_eagerly_computes_plain_gradients(model, plans):
    """Eager selective checkpointing replays the region: the same operations on the same inputs give the same
    gradients, and batch-norm's running statistics are updated once, as plain PyTorch's."""
    plain = copy.deepcopy(model)
    _loss(plain(X)).backward()
    planned = copy.deepcopy(model)
    _loss(with_plan(planned, plans[1])(X)).backward()
    for (name, p), q in zip(plain.named_parameters(), planned.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    for (name, b), c in zip(plain.named_buffers(), planned.buffers(), strict=True):
        torch.testing.assert_close(c, b, msg=name)


def test_a_forward_pass_that_runs_fewer_operations_than_the_plan_is_refused(model, plans):
    changed = copy.deepcopy(model)
    planned = with_plan(changed, plans[1])
    changed.extra = False  # the forward pass now skips the last conv and its norm
    with pytest.raises(UnsupportedProblem, match="plan again") as info:
        _loss(planned(X)).backward()
    assert "\n" not in str(info.value)


def _compiled_peak(module, model) -> int:
    """The counted peak of a compiled step (after the compiling one), Inductor's own buffers included."""
    step = torch.compile(compiled_step.fresh_call(module))
    _loss(step(X)).backward()  # compiles
    for p in model.parameters():
        p.grad = None
    with StepTracker(model) as tracker:
        tracker.track(X)
        tracker.track(Y)
        _loss(step(X)).backward()
    return tracker.report().peak_bytes


def test_inductor_runs_the_smallest_plan_in_less_memory_than_plain_compiled_training_and_trains_alike(model, plans):
    """Inductor itself, compiling plain training and training under the smallest plan: the planned step's counted
    peak is the predicted one, below the plain compiled step's, and two SGD steps under it land where plain compiled
    training's do, within the model's rounding noise."""
    torch._dynamo.reset()
    plan = plans[1]
    plain = _compiled_peak(m := copy.deepcopy(model), m)
    planned = _compiled_peak(with_plan(m := copy.deepcopy(model), plan), m)
    # the generated code's own memory lines, walked (`wrapper_walk`); beside the graphs, the loss's value and the
    # gradient seeding the backward pass, a float32 scalar each, are live too (8 bytes, not predicted)
    assert 0 <= planned - plan.peak_bytes <= 8
    assert planned < plain

    # the noise: plain eager training's own (threads, float64), or how far compiling alone moves it
    eager = train(copy.deepcopy(model), _batch)
    compiled = _compiled_training(copy.deepcopy(model))
    noise = max(rounding_noise(model, _batch, eager), (compiled - eager).norm().item())
    assert_trains_alike(_compiled_training(copy.deepcopy(model), plan), compiled, noise)


def _compiled_training(model, plan=None):
    """`plain_training.train` of `model` compiled (under `plan`: with_plan), compiled anew."""
    step = torch.compile(compiled_step.fresh_call(model if plan is None else with_plan(model, plan)))

    class Compiled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x):
            return step(x)

    return train(Compiled(), _batch)


class Broken(Net):
    """`Net` whose forward pass breaks Dynamo's graph in the middle."""

    def forward(self, x):
        x = self.body(x)
        torch._dynamo.graph_break()
        return self.head(x.mean((2, 3)))


def test_a_model_that_breaks_dynamos_graph_is_refused_in_one_line_at_planning():
    """Dynamo would run the checkpointed region eagerly: the plan's decisions would not reach a compiled graph."""
    torch.manual_seed(0)
    with pytest.raises(UnsupportedProblem, match="graph break") as info:
        plan_memory(Broken(), X, loss=_loss, compiled=True)
    assert "\n" not in str(info.value)


def test_a_converted_models_compiled_peak_adds_the_workspace_its_kernels_hold_under_their_budgets(model):
    """A budget is a ceiling: a converted layer runs the fastest configuration within it (or torch's own kernel,
    which holds none of ours), so the compiled peak adds what the kernels' prepared configurations hold under the
    plan's budgets, each where it runs, not the largest budget (MONAI's 2-D UNet converted: 2.5 MiB added where at
    most 1.25 MiB was held)."""
    # (one algorithm, no torch's own: every kernel then runs a configuration of ours, whichever is timed fastest)
    converted = convert(copy.deepcopy(model), backend="cpu", algos=("im2col_gemm",))
    plan = plan_memory(converted, X, loss=_loss, device="h100")  # (keeps everything: no limit; no kernel timed)
    big = 2**30  # a budget above every configuration's workspace
    kinds = ("fwd", "bwd_data", "bwd_filter")
    budgeted = dataclasses.replace(
        plan, conv_workspace=tuple(ConvWorkspace(op.name, k, big) for op in plan.capture.graph.conv_ops for k in kinds)
    )
    peak = compiled_step.compiled_peak(converted, budgeted, (X,), {}, _loss)
    # the configurations the handle prepared within those budgets, as the layers' routes hold them
    held = [
        k.config.workspace
        for conv in converted.modules()
        if isinstance(conv, ConvLayer)
        for route in conv._routes.values()
        if isinstance(route.budgets, PlanBudgets) and set(route.budgets.values()) == {big}
        for k in (route.fwd, route.bwd_data, route.bwd_filter)
        if k is not None and not native_only(k.config)
    ]
    assert len(held) > 1 and max(held) > 0  # (the kernels ran under the budgets, holding workspace)
    unbudgeted = compiled_step.compiled_peak(converted, dataclasses.replace(plan, conv_workspace=()), (X,), {}, _loss)
    # (each kernel's at its node, over what is live there: at most the most any kernel holds, not the budget)
    assert 0 < peak - unbudgeted <= max(held) < big
