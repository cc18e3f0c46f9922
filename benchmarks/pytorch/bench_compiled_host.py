"""Host time a compiled plan adds per step (issue 43), CPU, tiny tensors, one thread: compute made negligible, so
what is left is what a GPU step would pay on its host.

Interleaved, one step each per round (forward, backward), median microseconds:

- ``plain``: `torch.compile` of a 24-layer conv / batch-norm / ReLU chain on 2 x 4 x 4 x 4 inputs, compiled before
  Inductor's CPU allocator is wrapped (it binds the original);
- ``wrapped allocator``: the same model compiled after `watch_inductor_buffers` (a Python call per buffer, which
  StepTracker and with_plan install);
- ``with_plan``: `torch.compile(with_plan(model, plan))` of `plan_memory(..., compiled=True)`'s plan with no limit
  (convolutions' outputs kept, what Inductor fuses recomputed);
- ``compile(0.5)``: plain compile under `activation_memory_budget` 0.5.

    OMP_NUM_THREADS=1 python benchmarks/pytorch/bench_compiled_host.py --rounds 300
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._functorch.config
import torch._inductor.config
from torch import nn
from torch._C._dynamo import guards

from ucudnn.torch import plan_memory, with_plan
from ucudnn.torch.planning.compiled_step import fresh_call
from ucudnn.torch.running.labels import watch_inductor_buffers


def _net() -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(4 * 4 * 4, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=300, help="interleaved rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch._functorch.config.enable_autograd_cache = False  # every variant compiles from nothing
    torch._inductor.config.fx_graph_cache = False
    x, y = torch.randn(2, 4, 4, 4), torch.randint(0, 2, (2,))

    def loss(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)

    variants: dict[str, tuple] = {}

    def add(name: str, model: nn.Module, module: nn.Module, budget: float = 1.0) -> None:
        step = torch.compile(fresh_call(module))
        variants[name] = step, model, budget
        run(name)  # compiles

    def run(name: str) -> float:
        step, model, budget = variants[name]
        for p in model.parameters():
            p.grad = None
        with torch._functorch.config.patch(activation_memory_budget=budget):
            start = time.perf_counter()
            loss(step(x)).backward()
            return (time.perf_counter() - start) * 1e6

    original = guards._empty_strided_cpu
    add("plain", m := _net(), m)
    watch_inductor_buffers()
    assert guards._empty_strided_cpu is not original
    add("wrapped allocator", m := _net(), m)
    plan = plan_memory(m := _net(), x, loss=loss, compiled=True)
    add("with_plan", m, with_plan(m, plan))
    add("compile(0.5)", m := _net(), m, budget=0.5)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name in variants:
            times[name].append(run(name))
    base = statistics.median(times["plain"])
    for name, ts in times.items():
        print(f"{name:18s} {statistics.median(ts):7.0f} us per step ({statistics.median(ts) - base:+.0f} us)")


if __name__ == "__main__":
    main()
