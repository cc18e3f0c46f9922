"""Data-parallel training with a different batch on each rank, equal to one big-batch SGD step.

With `best_batch_size`, rank r trains on b_r samples of each global batch of B = sum_r b_r. Each rank's
loss is the mean over its own b_r samples, so its gradient is g_r = (1/b_r) sum_{i in r} grad l_i. The
global batch's gradient is

    g = (1/B) sum_i grad l_i = sum_r (b_r / B) g_r,

an all-reduce (sum) of the gradients weighted by b_r / B. The plain mean that DistributedDataParallel
takes, (1/R) sum_r g_r, is right only when every b_r is equal. Layers whose forward pass mixes
samples (BatchNorm in training mode) see only their rank's samples, as with any data parallelism.

- `UnevenSampler`: a batch sampler handing rank r its b_r indices of each global batch.
- `allreduce_gradients(model, local_batch, global_batch)`: after `loss.backward()`, before the step.
- `UnevenBatchState` + `uneven_batch_hook`: the same weighting as a DistributedDataParallel
  communication hook (`ddp.register_comm_hook(UnevenBatchState(b_r, B), uneven_batch_hook)`).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ucudnn.errors import InvalidInput

__all__ = ["UnevenBatchState", "UnevenSampler", "allreduce_gradients", "uneven_batch_hook"]


def _check_batches(local_batch: int, global_batch: int) -> None:
    for name, value in (("local_batch", local_batch), ("global_batch", global_batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidInput(f"{name} must be a non-negative integer, got {value!r}")
    if not 0 <= local_batch <= global_batch or global_batch == 0:
        raise InvalidInput(
            f"local_batch must lie in 0..global_batch and global_batch be positive, got {local_batch} of {global_batch}"
        )


class UnevenSampler(Sampler[list[int]]):
    """Rank `rank`'s share of each global batch: `batch_sizes[rank]` indices, at offset sum(batch_sizes[:rank]).

    Every rank draws the same order (the same `seed` and epoch; call `set_epoch` each epoch when
    shuffling) and cuts it into global batches of B = sum(batch_sizes); a last incomplete global
    batch is dropped, so every rank takes the same number of steps. A rank with batch 0 yields
    empty lists: it still takes part in each gradient all-reduce, with zero weight. Use it as
    ``DataLoader(dataset, batch_sampler=UnevenSampler(len(dataset), sizes, rank))``.
    """

    def __init__(
        self, num_samples: int, batch_sizes: Sequence[int], rank: int, *, shuffle: bool = True, seed: int = 0
    ) -> None:
        sizes = list(batch_sizes)
        if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 0 for b in sizes) or sum(sizes) == 0:
            raise InvalidInput(f"batch_sizes must be non-negative integers with a positive sum, got {batch_sizes!r}")
        if not isinstance(rank, int) or not 0 <= rank < len(sizes):
            raise InvalidInput(f"rank must be in 0..{len(sizes) - 1} (one batch size per rank), got {rank!r}")
        if not isinstance(num_samples, int) or num_samples < sum(sizes):
            raise InvalidInput(f"num_samples ({num_samples!r}) must hold at least one global batch of {sum(sizes)}")
        self.num_samples, self.batch_sizes, self.rank = num_samples, tuple(sizes), rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.global_batch = sum(sizes)
        self.offset = sum(sizes[:rank])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples // self.global_batch

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.num_samples)
        mine = self.batch_sizes[self.rank]
        for step in range(len(self)):
            start = step * self.global_batch + self.offset
            yield order[start : start + mine].tolist()


def allreduce_gradients(model: torch.nn.Module, local_batch: int, global_batch: int, group=None) -> None:
    """Replace every gradient by the global batch's: sum over ranks of (b_r / B) * g_r.

    Call after `loss.backward()` on a loss averaged over the rank's own samples, on every rank of
    `group` (the same parameters in the same order). A parameter without a gradient on this rank
    counts as zero. One flat all-reduce carries all gradients, plus b_r itself: the summed b_r must
    equal `global_batch` on every rank, else `InvalidInput` (raised on all ranks alike).
    """
    _check_batches(local_batch, global_batch)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    device, dtype = params[0].device, params[0].dtype
    weight = local_batch / global_batch
    flat = torch.cat(
        [
            (
                p.grad.detach().reshape(-1).to(dtype) * weight
                if p.grad is not None
                else torch.zeros(p.numel(), device=device, dtype=dtype)
            )
            for p in params
        ]
        + [torch.tensor([float(local_batch)], device=device, dtype=dtype)]
    )
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    total = round(flat[-1].item())
    if total != global_batch:
        raise InvalidInput(
            f"the ranks' local batches sum to {total}, not global_batch={global_batch}; "
            f"give each rank its own b_r and the same B"
        )
    offset = 0
    for p in params:
        part = flat[offset : offset + p.numel()].view_as(p)
        if p.grad is None:
            p.grad = part.clone()
        else:
            p.grad.copy_(part)
        offset += p.numel()


@dataclass(slots=True)
class UnevenBatchState:
    """The DDP hook's state: this rank's batch b_r, the global B, and the process group.

    Mutable on purpose: a run whose split changes (a new `best_batch_size`) updates it between steps.
    """

    local_batch: int
    global_batch: int
    group: object = None

    def __post_init__(self) -> None:
        _check_batches(self.local_batch, self.global_batch)


def uneven_batch_hook(state: UnevenBatchState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: all-reduce (sum) of each bucket weighted by b_r / B, not DDP's mean."""
    _check_batches(state.local_batch, state.global_batch)
    buffer = bucket.buffer()
    buffer.mul_(state.local_batch / state.global_batch)
    work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
