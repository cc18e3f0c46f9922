"""
Memory against time, beside PyTorch's own planners
==================================================

A plan trades step time for memory. This example puts ucudnn's plans (`plan_memory`, run by
`execute_plan`) beside what PyTorch offers for the same trade on one small model: the plain step,
`torch.utils.checkpoint.checkpoint_sequential` with 2 and 3 segments, and `torch.compile` with a
`torch._functorch.config.activation_memory_budget` of 0.5 (its min-cut partitioner under a knapsack budget).
Every point is measured: the peak counted by `ucudnn.torch.StepTracker` over one step, the step time the
median CPU time of 5 interleaved rounds.

It runs the project's benchmark `benchmarks/memory/bench_frontier.py` in small (its ``run_model`` and
``plot``), so the figures here and in benchmarks/BENCHMARKS.md are made the same way. The benchmark itself runs more
budgets, segments and rounds, and a ResNet-shaped model; `benchmarks/memory/bench_planners.py` adds models
nobody here wrote and PyTorch's selective-checkpointing ILP. One compile budget only: each budget compiles
the model's forward and backward anew, 10-15 s on a 2-core CPU. Downloaded, the script runs from
``docs/examples/`` of a checkout (it finds the benchmark there) with the ``plot`` and ``torch`` extras.
"""

# %%
# Set-up
# ------
# The benchmark's helpers are imported from the repository. Its plans are made through the default
# measurement cache, so ``UCUDNN_DB`` points at a cache file of this example's own for the run (the user's
# cache is never touched), and Inductor's on-disk caches are off, as the benchmark has them, so that the
# compiled step is compiled under its budget here.

import os
import sys
import tempfile
import types
from pathlib import Path

import torch
import torch._functorch.config
import torch._inductor.config

# The example runs in docs/examples/ (sphinx-gallery runs each example in its own folder; no __file__ there).
sys.path.insert(0, str(Path("../../benchmarks/memory").resolve()))
import bench_frontier  # from the repository's benchmarks, found through the path just set

from ucudnn.torch.running.labels import watch_inductor_buffers

folder = tempfile.TemporaryDirectory()
saved_db = os.environ.get("UCUDNN_DB")
os.environ["UCUDNN_DB"] = str(Path(folder.name) / "cache.db")
saved_caches = torch._functorch.config.enable_autograd_cache, torch._inductor.config.fx_graph_cache
torch._functorch.config.enable_autograd_cache = False
torch._inductor.config.fx_graph_cache = False
watch_inductor_buffers()  # count the buffers Inductor's generated kernels allocate

# %%
# The run
# -------
# A chain of six 3x3 convolutions with ReLUs (32 channels, batch 8, 32x32 images). ucudnn's ``optimal``
# policy is planned at the peak each ``checkpoint_sequential`` variant reached: the comparison at equal
# memory. The tables: every point (with each plan's predicted peak and time),
# then ucudnn's plan at each checkpoint peak, then whether any PyTorch point is both smaller and faster
# than a point of ucudnn's frontier by more than 5%.

args = types.SimpleNamespace(
    layers=6,
    channels=32,
    batch=8,
    size=32,
    segments=[2, 3],
    budgets=[0.5],
    policies=["optimal"],
    limits=[],
    rounds=5,
)
result = bench_frontier.run_model("chain", args)

# %%
# The frontier
# ------------
# Lower left is better: less memory and a shorter step. ucudnn's points are joined (its frontier), as are
# the ``checkpoint_sequential`` ones. Step times are this machine's while the docs were built: on a busy
# machine they move, the peaks do not.

bench_frontier.plot([result], str(Path(folder.name) / "frontier.png"))

os.environ.pop("UCUDNN_DB")
if saved_db is not None:
    os.environ["UCUDNN_DB"] = saved_db
torch._functorch.config.enable_autograd_cache, torch._inductor.config.fx_graph_cache = saved_caches
folder.cleanup()
