"""
A WR table and its speedup
==========================

ucudnn measures every algorithm of each convolution kernel at several micro-batch sizes and picks,
per kernel, the fastest configuration whose workspace fits a limit (WR). Here a `ucudnn.Handle`
plans two layers on the CPU backend within 8 MiB per kernel, prints what it chose, and plots the
speedup over the baseline: the fastest algorithm that fits the limit on the undivided batch, which is
what cuDNN's or PyTorch's own selection would run.

The same table, from the command line: ``ucudnn bench --layer SPEC --workspace 8MiB --backend cpu``
(:doc:`Benchmarking convolutions </guide-bench>`).
"""

# %%
# The layers and the handle
# -------------------------
# AlexNet's conv2 at batch 8 (the README's main job) and a VGG-style 3x3 layer. The
# measurements go to a cache file of their own, removed at the end: the user's default cache
# (``$UCUDNN_DB`` or the user cache folder) is never touched. ``reps=3`` timed runs per measurement, the
# median kept.

import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

import ucudnn

MiB = 2**20

# name: (input shape (n, c, h, w), weight shape (k, c/groups, r, s), padding, groups), as PyTorch holds them
LAYERS = {
    "alexnet conv2": ((8, 96, 27, 27), (256, 48, 5, 5), 2, 2),
    "vgg 3x3": ((8, 64, 28, 28), (64, 64, 3, 3), 1, 1),
}
KINDS = ("fwd", "bwd_data", "bwd_filter")
LIMIT = "8MiB"

folder = tempfile.TemporaryDirectory()
handle = ucudnn.Handle(backend="cpu", workspace_limit=LIMIT, db=str(Path(folder.name) / "cache.db"), reps=3)

# %%
# Planning
# --------
# `Handle.prepare` plans a kernel without running it (as ``cudnnGet*Algorithm`` does): it measures
# what the cache lacks, solves for the fastest configuration within the limit, and returns it.
# `Handle.choices` then lists every planned kernel with its configuration and its baseline.

for name, (x_shape, w_shape, padding, groups) in LAYERS.items():
    for kind in KINDS:
        handle.prepare(kind, x_shape, w_shape, padding=padding, groups=groups, layer=name)
choices = handle.choices()
handle.close()
folder.cleanup()

# %%
# The table
# ---------
# A configuration such as ``8x1:native`` runs the batch as 8 micro-batches of 1 sample, each by
# PyTorch's own convolution (``native``); its time is the sum of the micro-batches', its workspace the
# largest of theirs. ``(none fits)``: no algorithm fits the limit on the whole batch, so no baseline.

header = (
    f"{'layer':<15} {'kind':<10} {'baseline':<11} {'base ms':>8}  {'configuration':<22} {'ms':>8} "
    f"{'workspace':>10} {'speedup':>8}"
)
print(f"WR, {LIMIT} per kernel, CPU backend ({handle.backend.name})")
print(header)
print("-" * len(header))
speedups = []
for c in choices:
    base = c.baseline
    speedup = base.time / c.config.time if base else float("nan")
    speedups.append(speedup)
    print(
        f"{c.layer:<15} {c.kind:<10} {base.algo if base else '(none fits)':<11} "
        f"{f'{base.time:.3f}' if base else '-':>8}  {c.config.describe():<22} {c.config.time:8.3f} "
        f"{c.config.workspace / MiB:6.2f} MiB {speedup:7.2f}x"
    )
timed = [c for c in choices if c.baseline]
total = sum(c.baseline.time for c in timed) / sum(c.config.time for c in timed)
print(f"speedup: {total:.2f}x in total over the {len(timed)} kernels with a baseline (sums of their ms)")

# %%
# The speedup per kernel
# ----------------------
# Above 1 (on a log scale): the chosen configuration, written over its bar, beats the best undivided
# algorithm within the same limit; 1 where the undivided algorithm is itself the best choice. The figures
# are this machine's, measured while the docs were built: they move with the CPU and its load.

fig, ax = plt.subplots(figsize=(8, 4.5))
ax.bar(range(len(choices)), speedups, color="tab:green")
for i, c in enumerate(choices):
    ax.annotate(c.config.describe(), (i, speedups[i]), ha="center", va="bottom", fontsize=7)
ax.axhline(1.0, color="k", linewidth=0.8)
ax.set_yscale("log")
ax.set_xticks(range(len(choices)), [f"{c.layer}\n{c.kind}" for c in choices], fontsize=8)
ax.set_ylabel("speedup over the undivided baseline")
ax.set_title(f"WR within {LIMIT} per kernel, CPU backend")
fig.tight_layout()
