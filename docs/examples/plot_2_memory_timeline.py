"""
A memory plan's timeline against the plain step's
=================================================

`ucudnn.torch.plan_memory` plans where each feature map of a training step lives (kept, offloaded to
host memory, recomputed) so that the step's peak fits a memory limit. Here a small CNN is planned twice:
with no limit (every map that the backward pass reads kept: the plain step) and at 75% of that plan's peak, which forces some maps
out. The planner's simulation of each plan (`MemoryPlan.simulation`) gives the memory in use over the
step; the two are drawn one over the other. Then `ucudnn.torch.check_plan` runs the limited plan for
real under `execute_plan` and counts its peak with `ucudnn.torch.StepTracker`, to show the prediction held.

More: :doc:`Planning memory </guide-memory>`.
"""

# %%
# The model and its batch
# -----------------------
# Six 3x3 convolutions with ReLUs and a classifier, batch 8 of 32x32 images. The convolutions' kernels
# are measured through a cache file of its own (``db=``), removed at the end: never the user's default cache.

import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from torch import nn

import ucudnn.torch

MiB = 2**20
torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(3, 32, 3, padding=1),
    nn.ReLU(),
    *[m for _ in range(5) for m in (nn.Conv2d(32, 32, 3, padding=1), nn.ReLU())],
    nn.AdaptiveAvgPool2d(1),
    nn.Flatten(),
    nn.Linear(32, 10),
)
x = torch.randn(8, 3, 32, 32)
y = torch.randint(0, 10, (8,))


def loss(out):
    return nn.functional.cross_entropy(out, y)


folder = tempfile.TemporaryDirectory()
db = str(Path(folder.name) / "cache.db")

# %%
# Two plans
# ---------
# Without a limit the plan keeps every map that the backward pass reads and releases the others, as PyTorch's
# autograd does: its simulation is the plain step's memory. At 75% of its peak, ``policy="optimal"`` (an
# integer program) chooses what to offload or recompute at the least cost in step time.

plain = ucudnn.torch.plan_memory(model, x, policy="optimal", loss=loss, db=db)
limit = int(0.75 * plain.peak_bytes)
plan = ucudnn.torch.plan_memory(model, x, memory_limit=limit, policy="optimal", loss=loss, db=db)


def actions(p):
    """How many feature maps the plan keeps, offloads, recomputes or releases."""
    counts: dict[str, int] = {}
    for t in p.tensors:
        counts[t.action] = counts.get(t.action, 0) + 1
    return ", ".join(f"{n} {a}" for a, n in sorted(counts.items()))


print(f"no limit:    peak {plain.peak_bytes / MiB:5.2f} MiB, {plain.step_ms:6.1f} ms predicted; {actions(plain)}")
print(
    f"{limit / MiB:.2f} MiB:   peak {plan.peak_bytes / MiB:5.2f} MiB, {plan.step_ms:6.1f} ms predicted; {actions(plan)}"
)
print(f"fits the limit: {plan.fits}")

# %%
# The plan, run for real
# ----------------------
# `check_plan` runs warm-up steps under `execute_plan`, then one step under a `StepTracker` (which counts
# every live tensor storage by category), then timed steps. The model is left as it was. The peaks are counts
# of bytes, which no other work on the machine changes; the step times are timings (the prediction's from the
# operations timed while planning), which it moves.

check = ucudnn.torch.check_plan(model, plan, x, y, loss=loss)
print(
    f"predicted peak {check.predicted_peak_bytes / MiB:.2f} MiB, counted {check.peak_bytes / MiB:.2f} MiB "
    f"(ratio {check.peak_ratio:.4f}); step {check.step_ms:.1f} ms against {check.predicted_step_ms:.1f} ms predicted"
)
folder.cleanup()

# %%
# The plain step, counted
# -----------------------
# The same tracker over one plain PyTorch step (no plan): its peak is the one the unlimited plan predicts.
# The input batch is counted as the plan counts it; the weight gradients are freed first, as
# ``optimizer.zero_grad()`` does.

for p in model.parameters():
    p.grad = None
with ucudnn.torch.StepTracker(model) as tracker:
    tracker.track(x)
    loss(model(x)).backward()
plain_peak = tracker.report().peak_bytes
print(f"plain step: predicted peak {plain.peak_bytes / MiB:.2f} MiB, counted {plain_peak / MiB:.2f} MiB")

# %%
# Memory over the step
# --------------------
# Each curve steps at every allocation and free of the simulated step (its x-axis: the simulated
# time). The limited plan's curve stays under the dashed limit; the dotted lines are the peaks counted in
# the real steps.

fig, ax = plt.subplots(figsize=(8, 4.5))
for p, label, color in ((plain, "no limit (the plain step)", "tab:gray"), (plan, "ucudnn optimal", "tab:red")):
    times, used = zip(*p.simulation.memory)
    ax.step(
        times, [b / MiB for b in used], where="post", color=color, label=f"{label}: peak {p.peak_bytes / MiB:.1f} MiB"
    )
ax.axhline(limit / MiB, color="tab:red", linestyle="--", linewidth=0.8, label=f"limit {limit / MiB:.1f} MiB")
ax.axhline(check.peak_bytes / MiB, color="tab:red", linestyle=":", label="counted peak, planned step")
ax.axhline(plain_peak / MiB, color="tab:gray", linestyle=":", label="counted peak, plain step")
ax.set_xlabel("simulated time in the step, ms")
ax.set_ylabel("memory in use, MiB")
ax.set_title("A training step's memory, CPU, batch 8")
ax.legend(fontsize=8)
fig.tight_layout()
