"""Inside a PyTorch step, ucudnn's NumPy algorithms run on one thread: torch's thread pool owns the cores.

Two thread pools that spin while waiting (torch's OpenMP, NumPy's OpenBLAS) took turns on the same
two cores and made a converted ResNet-18 train 2.5-5x slower than plain PyTorch; these tests watch
the thread settings during the kernel calls themselves, not a timing.
"""

import pytest
import scipy.fft
import torch
from threadpoolctl import threadpool_info, threadpool_limits
from torch import nn

from ucudnn.backends.cpu import backend as cpu
from ucudnn.handle import Handle
from ucudnn.torch import convert


def _blas_threads() -> set[int]:
    return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}


@pytest.fixture
def watched(monkeypatch):
    """Record BLAS threads and scipy.fft workers while every NumPy algorithm computes: checked runs
    (`_RUNS`) and prepared launches (`_PREPARE`'s run)."""
    seen = []
    for algo, run in list(cpu._RUNS.items()):

        def watching(*args, _run=run, _algo=algo):
            seen.append((_algo, _blas_threads(), scipy.fft.get_workers()))
            return _run(*args)

        monkeypatch.setitem(cpu._RUNS, algo, watching)
    for algo, prepare in list(cpu._PREPARE.items()):

        def preparing(problem, _prepare=prepare, _algo=algo):
            views, run = _prepare(problem)

            def watching(*args):
                seen.append((_algo, _blas_threads(), scipy.fft.get_workers()))
                return run(*args)

            return views, watching

        monkeypatch.setitem(cpu._PREPARE, algo, preparing)
    return seen


def _one_thread(seen) -> bool:
    """BLAS on one thread for every algorithm, and scipy.fft on one worker for fft (the only one that calls it)."""
    return all(blas == {1} and (workers == 1 or algo != "fft") for algo, blas, workers in seen)


def _step(model, x):
    model(x).square().mean().backward()


def test_a_converted_models_numpy_kernels_run_on_one_thread_inside_a_step(watched):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    convert(model, backend="cpu", policy="undivided", algos=["im2col_gemm", "fft"], reps=1, db=False)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    with threadpool_limits(limits=2, user_api="blas"):  # what the process would give BLAS otherwise
        _step(model, x)
        watched.clear()  # the first step also measured; now one step of running alone
        _step(model, x)
        after = _blas_threads()
    assert _one_thread(watched), watched
    assert len(watched) == 2 * 3  # two layers, three kernels each, every one a NumPy algorithm
    assert after == {2}  # the limit is the kernel's own: the process's setting is back afterwards


def test_measurements_run_as_the_step_runs_and_are_keyed_apart(watched):
    """The handle's measurements take the same one-thread setting, and a plain backend's (all
    cores) are stored under another key, so neither stands in for the other."""
    one = cpu.CpuBackend(numpy_threads=1)
    with threadpool_limits(limits=2, user_api="blas"):
        Handle(backend=one, policy="undivided", algos=["im2col_gemm"], reps=1, db=False).conv_forward(
            *(a.detach().numpy() for a in (torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3))), padding=1
        )
        assert watched and _one_thread(watched)
        watched.clear()
        _run_im2col(cpu.CpuBackend())
        assert watched and all(blas == {2} for _, blas, _ in watched)
    assert one.versions_for("im2col_gemm") != cpu.CpuBackend().versions_for("im2col_gemm")
    assert one.versions_for("native") == cpu.CpuBackend().versions_for("native")  # torch's own: no NumPy threads
    assert one.settings() == {"numpy_threads": "1"} and cpu.CpuBackend().settings() == {}


def _run_im2col(backend) -> None:
    import numpy as np

    from ucudnn.problem import ConvProblem

    p = ConvProblem.parse("n=2,c=3,h=8,w=8,k=4,r=3,s=3,pad=1")
    rng = np.random.default_rng(0)
    backend.run(
        p,
        "im2col_gemm",
        x=rng.standard_normal(p.x_shape, dtype=np.float32),
        w=rng.standard_normal(p.w_shape, dtype=np.float32),
        out=np.zeros(p.out_shape, np.float32),
        workspace=backend.empty_workspace(backend.workspace_size(p, "im2col_gemm")),
    )


def test_bad_thread_counts_are_refused():
    from ucudnn.errors import InvalidInput

    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(InvalidInput, match="numpy_threads"):
            cpu.CpuBackend(numpy_threads=bad)
