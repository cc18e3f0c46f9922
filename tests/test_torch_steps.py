"""ucudnn.torch in steady state (issue 10): prepared once per layer and shape, then only launched;
WD learned from the first forward pass; autocast and empty batches as nn.Conv2d handles them;
on a GPU, one allocator, bfloat16, channels_last and CUDA-graph capture."""

from __future__ import annotations

import copy
import sys
import warnings
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
from torch import nn
from torch.nn import functional as F

import ucudnn
from ucudnn import Handle, LateRegistrationWarning, UnsupportedProblem
from ucudnn.backends.cpu import CpuBackend
from ucudnn.torch import convert

NUMPY_ALGOS = ["im2col_gemm", "shift_gemm", "fft", "winograd"]


class Net(nn.Module):
    """Three convolutions (one strided, one grouped with bias), batch norm, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False)
        self.conv3 = nn.Conv2d(8, 12, 3, padding=1, groups=4)
        self.fc = nn.Linear(12, 5)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv1(x)))
        x = torch.relu(self.conv3(torch.relu(self.conv2(x))))
        return self.fc(x.mean((2, 3)))


LAYERS = ["conv1", "conv2", "conv3"]


class Counting(CpuBackend):
    """The cpu backend, counting checked runs, prepared launchers, measurements and allocations."""

    def __init__(self) -> None:
        self.counts = {"run": 0, "prepare_run": 0, "measure": 0, "empty_workspace": 0}
        self.timing = False

    def _count(self, name):
        self.counts[name] += 1

    def run(self, *args, **kwargs):
        if not self.timing:  # a kernel the handle ran, not a measurement
            self._count("run")
        return super().run(*args, **kwargs)

    def prepare_run(self, *args, **kwargs):
        self._count("prepare_run")
        return super().prepare_run(*args, **kwargs)

    def measure(self, *args, **kwargs):
        self._count("measure")
        self.timing = True
        try:
            return super().measure(*args, **kwargs)
        finally:
            self.timing = False

    def empty_workspace(self, nbytes):
        self._count("empty_workspace")
        return super().empty_workspace(nbytes)


def _close(actual, expected, rtol=1e-4, atol=1e-4):
    scale = max(1.0, float(expected.detach().abs().max()))
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * scale)


def _batch(seed, n=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 10, 10, generator=g), torch.randint(0, 5, (n,), generator=g)


def _train(models, steps, after_step=None):
    """SGD steps on each model from one state; asserts equal losses, gradients and weights."""
    optims = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    device = next(models[0].parameters()).device
    for step in range(steps):
        x, y = (t.to(device) for t in _batch(100 + step))
        losses = []
        for m, opt in zip(models, optims):
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss)
        for m in models[1:]:
            _close(losses[1], losses[0])
            for p, q in zip(models[0].parameters(), m.parameters(), strict=True):
                _close(q, p)
        if after_step is not None:
            after_step(step)


@pytest.mark.parametrize(
    "options",
    [
        {"algos": NUMPY_ALGOS, "policy": "undivided"},
        {"algos": ["im2col_gemm"], "policy": (1, 2), "workspace_limit": 40_000},  # micro-batched kernels
    ],
    ids=["numpy", "micro-batched"],
)
def test_steady_state_steps_plan_check_and_allocate_nothing(options, monkeypatch):
    torch.manual_seed(0)
    ref = Net()
    backend = Counting()
    model = convert(copy.deepcopy(ref), handle=Handle(backend=backend, reps=1, db=False, **options))
    handle = model.conv1.handle
    lookups = []
    real_lookup = Handle._lookup
    monkeypatch.setattr(Handle, "_lookup", lambda self, *a, **k: lookups.append(a) or real_lookup(self, *a, **k))
    seen = {}

    def after_step(step):
        if step == 0:
            seen.update(backend.counts, lookups=len(lookups), generation=handle.generation, buffer=id(handle._buffer))
            assert backend.counts["run"] > 0 and len(lookups) > 0
            return
        # after the first step: no measurement, no checked run, no launcher, no workspace, no lookup
        assert backend.counts == {k: seen[k] for k in backend.counts}, step
        assert len(lookups) == seen["lookups"] and handle.generation == seen["generation"]
        assert id(handle._buffer) == seen["buffer"]

    _train([ref, model], 3, after_step)
    kernels = {(c.layer, c.kind) for c in handle.choices()}
    assert kernels == {(n, k) for n in LAYERS for k in ("fwd", "bwd_data", "bwd_filter")} - {("conv1", "bwd_data")}
    # one checked run per micro-batch of each kernel: validation once per layer, not per call
    assert backend.counts["run"] == sum(len(c.config.micros) for c in handle.choices())
    if "workspace_limit" in options:
        assert any(c.micro_batched for c in handle.choices())
        assert 0 < handle.peak_workspace <= options["workspace_limit"]


def test_native_plans_run_as_torch_itself():
    torch.manual_seed(0)
    ref = Net()
    model = convert(copy.deepcopy(ref), backend="cpu", policy="undivided", algos=["native"], reps=1, db=False)
    x, _ = _batch(1)
    out = model(x)
    # every kernel is torch's own convolution on the whole batch: the graph is torch's, no Function
    names = [type(f).__name__ for f in _grad_fns(out)]
    assert "ConvolutionBackward0" in names and not any("Conv2dFunction" in n for n in names)
    _train([ref, model], 2)


def _grad_fns(t):
    stack, seen = [t.grad_fn], []
    while stack:
        f = stack.pop()
        if f is None or f in seen:
            continue
        seen.append(f)
        stack.extend(g for g, _ in f.next_functions)
    return seen


def test_wd_learns_the_layers_from_the_first_forward_and_solves_once(monkeypatch):
    torch.manual_seed(0)
    ref = Net()
    backend = Counting()
    handle = Handle(backend=backend, total_workspace="1MiB", policy="powerOfTwo", reps=1, db=False)
    model = convert(copy.deepcopy(ref), handle=handle)  # no announce
    solves = []
    arena = []
    real_solve = Handle._solve_wd_fresh
    monkeypatch.setattr(Handle, "_solve_wd_fresh", lambda self, *a: solves.append(1) or real_solve(self, *a))

    def after_step(step):
        if step == 0:  # torch computed the first step; every layer and kind is known, nothing solved
            assert set(handle.layers) == set(LAYERS) and not handle.wd_solved and backend.counts["run"] == 0
            assert handle.layers["conv1"][1] == frozenset({"fwd", "bwd_filter"})
            assert handle.layers["conv2"][1] == frozenset({"fwd", "bwd_data", "bwd_filter"})
        elif step == 1:
            assert handle.wd_solved and backend.counts["run"] > 0
            arena.append(handle.arena)
        else:
            assert handle.arena is arena[0]  # allocated once

    with warnings.catch_warnings():
        warnings.simplefilter("error", LateRegistrationWarning)
        _train([ref, model], 4, after_step)
    assert len(solves) == 1
    assert handle.arena is not None and handle.arena.nbytes == handle.total_workspace
    assert len(handle.choices()) == 3 * len(LAYERS) - 1
    assert 0 < handle.peak_workspace <= handle.total_workspace


def test_wd_learns_each_layer_in_the_layout_its_route_runs(monkeypatch):
    # On CUDA a channels-last input runs as an NHWC problem. Learnt as NCHW, every layer's first real
    # call registered it anew, and WD solved the network again (measuring NCHW kernels) per layer.
    from ucudnn.torch.converting import layer as conv_module

    def channels_last_anywhere(t):  # what _layout_name says for CUDA tensors, here for CPU ones
        return "NHWC" if not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last) else "NCHW"

    monkeypatch.setattr(conv_module, "_layout_name", channels_last_anywhere)
    handle = Handle(backend=CpuBackend(), total_workspace="1MiB", db=False)
    model = convert(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1)), handle=handle)
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    model(x)  # the learning pass: torch computes, the layer registers
    assert [template.layout for template, _ in handle.layers.values()] == ["NHWC"]


def test_autocast_bfloat16_on_the_cpu_is_refused_clearly():
    torch.manual_seed(0)
    model = convert(Net(), backend="cpu", policy="undivided", reps=1, db=False)
    x, _ = _batch(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert nn.Conv2d(3, 4, 3)(x).dtype == torch.bfloat16  # what autocast does to a convolution
        with pytest.raises(UnsupportedProblem, match="cpu backend cannot run bfloat16.*autocast"):
            model(x)
    assert model(x).dtype == torch.float32  # outside autocast it runs


def test_autocast_leaves_float64_as_it_leaves_it_for_nn_conv2d():
    torch.manual_seed(0)
    plain = nn.Conv2d(3, 4, 3, padding=1).double()
    ours = convert(copy.deepcopy(plain), backend="cpu", policy="undivided", reps=1, db=False)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = plain(x)
        got = ours(x)  # cast to bfloat16, the cpu backend would refuse it
    assert expected.dtype == got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_empty_batch_returns_what_nn_conv2d_returns():
    torch.manual_seed(0)
    plain = nn.Conv2d(3, 6, 3, stride=2, padding=1)
    ours = convert(copy.deepcopy(plain), backend="cpu", policy="undivided", reps=1, db=False)
    xs = [torch.randn(0, 3, 9, 9, requires_grad=True) for _ in range(2)]
    outs = [m(x) for m, x in zip((plain, ours), xs)]
    assert outs[1].shape == outs[0].shape == (0, 6, 5, 5)
    for out in outs:
        out.sum().backward()
    assert xs[1].grad.shape == xs[0].grad.shape
    torch.testing.assert_close(ours.weight.grad, plain.weight.grad)
    torch.testing.assert_close(ours.bias.grad, plain.bias.grad)
    assert ours.handle.choices() == []  # nothing to plan


def test_out_of_memory_in_torchs_allocator_reaches_the_handle_as_a_memory_error(monkeypatch):
    # On CUDA, CuPy allocates from torch's caching allocator, whose OutOfMemoryError is a RuntimeError:
    # the handle took it for a lasting failure and recorded the planned algorithm unusable in the cache.
    from ucudnn.torch.converting import launch as conv_module

    def empty(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=SimpleNamespace()))
    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(MemoryError, match="out of memory"):
        conv_module._torch_allocator(0)(2 * 2**30)


# ---- GPU --------------------------------------------------------------------------------------


def _cuda_handle(**options):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    pytest.importorskip("cupy", reason="CUDA tensors go through CuPy")
    try:
        return Handle(backend="cudnn", reps=1, db="sqlite://", **options)
    except ucudnn.BackendUnavailable as exc:
        pytest.skip(f"cudnn backend unavailable: {exc}")


@pytest.mark.gpu
def test_cuda_workspaces_come_from_torch_and_no_cupy_pool_holds_memory():
    handle = _cuda_handle(policy="undivided", total_workspace="64MiB")
    import cupy

    torch.manual_seed(0)
    ref = Net().cuda()
    model = convert(copy.deepcopy(ref), handle=handle)
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    held = pool.total_bytes()  # arrays other tests keep alive (a failed test's traceback holds its frames)
    torch.cuda.reset_peak_memory_stats()
    _train([ref, model], 3)
    torch.cuda.synchronize()
    # a block CuPy's pool took during training would stay in it (freed blocks are cached, not returned)
    assert pool.total_bytes() == held, f"CuPy's pool grew from {held} to {pool.total_bytes()} B"
    # each run takes its workspace from torch's allocator and lets it go (CudnnBackend.workspace_per_run):
    # the WD plan divides 64 MiB, no arena is held between runs
    assert handle.arena is None and handle.workspace_bytes == 0, (handle.arena, handle.workspace_bytes)
    assert handle.peak_workspace <= 64 * 2**20
    assert torch.cuda.max_memory_allocated() >= handle.peak_workspace, (
        torch.cuda.max_memory_allocated(),
        handle.peak_workspace,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_autocast_half_precisions_and_channels_last(dtype):
    handle = _cuda_handle(policy="undivided", workspace_limit="64MiB")
    torch.manual_seed(0)
    ref = Net().cuda().to(memory_format=torch.channels_last)
    model = convert(copy.deepcopy(ref), handle=handle)
    x = torch.randn(8, 3, 16, 16, device="cuda").to(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=dtype):
        outs = [m(x) for m in (ref, model)]
    _close(outs[1].float(), outs[0].float(), rtol=3e-2, atol=3e-2)
    for out in outs:
        out.float().square().sum().backward()
    for p, q in zip(ref.parameters(), model.parameters(), strict=True):
        _close(q.grad, p.grad, rtol=5e-2, atol=5e-2)
    assert {c.problem.dtype for c in handle.choices()} == {str(dtype).removeprefix("torch.")}
    assert {c.problem.layout for c in handle.choices()} == {"NHWC"}


@pytest.mark.gpu
def test_cuda_graph_capture_of_a_training_step():
    handle = _cuda_handle(policy="undivided", workspace_limit="64MiB")
    torch.manual_seed(0)
    model = convert(Net().cuda(), handle=handle)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: replays must give the same loss
    x, y = (t.cuda() for t in _batch(3))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up: plans and workspaces made before capture
            opt.zero_grad(set_to_none=False)
            eager = F.cross_entropy(model(x), y)
            eager.backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(loss, eager.detach(), rtol=1e-4, atol=1e-4)
