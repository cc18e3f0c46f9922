"""Uneven data parallelism: 3 gloo ranks with batches 2, 5 and 9 of 16 train exactly like one process on 16."""

import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist
import torch.multiprocessing as mp

from ucudnn.errors import InvalidInput
from ucudnn.torch.distributed import UnevenBatchState, UnevenSampler, allreduce_gradients, uneven_batch_hook

SIZES = (2, 5, 9)
GLOBAL = sum(SIZES)
STEPS = 3
TIMEOUT_S = 120


def make_data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(GLOBAL * STEPS, 3, 8, 8, generator=g), torch.randint(0, 4, (GLOBAL * STEPS,), generator=g)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 4)
    )


def train(model, batches, reduce):
    """SGD with momentum over `batches`; `reduce(model, b)` turns local gradients into global ones."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = make_data()
    for idx in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx]) if idx else None
        if loss is not None:
            loss.backward()
        reduce(model, len(idx))
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def worker(rank, init, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=len(SIZES))
    try:
        batches = list(UnevenSampler(GLOBAL * STEPS, SIZES, rank, seed=3))
        manual = train(make_model(), batches, lambda m, b: allreduce_gradients(m, b, GLOBAL))
        ddp = torch.nn.parallel.DistributedDataParallel(make_model())
        ddp.register_comm_hook(UnevenBatchState(SIZES[rank], GLOBAL), uneven_batch_hook)
        hooked = train(ddp, batches, lambda m, b: None)
        # DDP's own mean, for contrast: with unequal batches it must differ from the big-batch step.
        plain = train(torch.nn.parallel.DistributedDataParallel(make_model()), batches, lambda m, b: None)
        torch.save({"manual": manual, "hooked": hooked, "plain": plain}, f"{out_dir}/rank{rank}.pt")
        # every rank done with its collectives before any tears gloo down: a rank destroying the group
        # while another still talks to it was once aborted by gloo ("terminate called ...") under load
        del ddp
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_three_uneven_ranks_equal_single_process_big_batch_sgd(tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    ctx = mp.spawn(worker, args=(init, str(tmp_path)), nprocs=len(SIZES), join=False)
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"gloo ranks did not finish within {TIMEOUT_S} s")
    reference = train(make_model(), list(UnevenSampler(GLOBAL * STEPS, (GLOBAL,), 0, seed=3)), lambda m, b: None)
    for rank in range(len(SIZES)):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name in ("manual", "hooked"):
            for p, ref in zip(got[name], reference, strict=True):
                torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-6, msg=f"rank {rank}, {name}")
        assert any(not torch.allclose(p, ref, rtol=1e-4, atol=1e-5) for p, ref in zip(got["plain"], reference))


def test_sampler_covers_each_global_batch_once_across_ranks():
    sizes = (0, 3, 5)
    per_rank = [list(UnevenSampler(20, sizes, r, seed=1)) for r in range(3)]
    assert [len(b) for b in per_rank] == [2, 2, 2]  # 20 // 8 global batches; the last 4 samples dropped
    for step in range(2):
        assert [len(per_rank[r][step]) for r in range(3)] == [0, 3, 5]
        union = sorted(i for r in range(3) for i in per_rank[r][step])
        assert len(set(union)) == 8
    every = [i for r in range(3) for batch in per_rank[r] for i in batch]
    assert len(every) == len(set(every)) == 16
    shuffled = UnevenSampler(20, sizes, 1, seed=1)
    first = list(shuffled)
    shuffled.set_epoch(1)
    assert list(shuffled) != first
    assert list(UnevenSampler(8, (3, 5), 1, shuffle=False)) == [[3, 4, 5, 6, 7]]


@pytest.mark.parametrize(
    "args, match",
    [
        ((10, (), 0), "batch_sizes"),
        ((10, (0, 0), 0), "batch_sizes"),
        ((10, (2, -1), 0), "batch_sizes"),
        ((10, (2, 3), 2), "rank"),
        ((4, (2, 3), 0), "num_samples"),
    ],
)
def test_sampler_rejects_bad_arguments(args, match):
    with pytest.raises(InvalidInput, match=match):
        UnevenSampler(*args)


@pytest.mark.parametrize("local, total", [(-1, 4), (5, 4), (0, 0), (1.5, 4)])
def test_batches_are_checked(local, total):
    with pytest.raises(InvalidInput):
        UnevenBatchState(local, total)
    with pytest.raises(InvalidInput):
        allreduce_gradients(torch.nn.Linear(1, 1), local, total)


def test_single_rank_group_checks_the_summed_batch(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rv'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(2, 1)
        model(torch.ones(3, 2)).mean().backward()
        before = model.weight.grad.clone()
        allreduce_gradients(model, 3, 3)
        torch.testing.assert_close(model.weight.grad, before)  # one rank with all of B: unchanged
        with pytest.raises(InvalidInput, match="sum to 2, not global_batch=3"):
            allreduce_gradients(model, 2, 3)
    finally:
        dist.destroy_process_group()
