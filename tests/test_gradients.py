"""Gradient buffers as autograd holds them (`ucudnn.memory.gradients`): lives worked out by hand on small
traced models, and plans that count them reaching the peak a real step reaches (`StepTracker`)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from ucudnn.memory.gradients import gradient_lives  # noqa: E402
from ucudnn.memory.graph import trace  # noqa: E402
from ucudnn.torch.check import check_plan  # noqa: E402
from ucudnn.torch.memory import plan_memory  # noqa: E402


class Residual(nn.Module):
    """stem -> conv, add(conv, stem), ReLU in place, pool, flatten, fc."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, 2)

    def forward(self, x):
        s = self.stem(x)
        out = self.relu(self.conv(s) + s)
        return self.fc(torch.flatten(self.pool(out), 1))


class Dense(nn.Module):
    """stem -> conv -> ReLU, cat(stem, ReLU), pool, flatten, fc."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * c, 2)

    def forward(self, x):
        s = self.stem(x)
        out = torch.cat([s, torch.relu(self.conv(s))], 1)
        return self.fc(torch.flatten(self.pool(out), 1))


def _lives(model):
    graph = trace(model, torch.randn(2, 3, 8, 8))
    index = {(s.op, s.phase): s.index for s in graph.steps}
    return gradient_lives(graph, graph.steps), lambda op: index[(op, "bwd")]


def test_an_add_passes_its_gradient_on_and_an_in_place_relu_replaces_its_own():
    lives, bwd = _lives(Residual())
    fmap = 2 * 4 * 8 * 8 * 4  # one 4-channel 8x8 map of batch 2, float32
    assert lives == [
        ("grad:fc", 2 * 2 * 4, bwd("loss"), bwd("fc")),
        ("grad:pool", 2 * 4 * 4, bwd("fc"), bwd("pool")),   # the flatten's view passes it on: no buffer
        ("grad:add", fmap, bwd("pool"), bwd("relu")),       # replaced by the ReLU's new gradient, freed after
        # the ReLU's gradient is the add's, and both its inputs' (no buffers of their own), until the
        # conv's backward step adds the stem's second part: the sum goes into that new part
        ("grad:add#2", fmap, bwd("relu"), bwd("conv")),
        ("grad:stem", fmap, bwd("conv"), bwd("stem")),
    ]


def test_a_concatenations_slices_hold_its_whole_gradient_until_summed():
    lives, bwd = _lives(Dense())
    fmap = 2 * 4 * 8 * 8 * 4
    assert lives == [
        ("grad:fc", 2 * 2 * 4, bwd("loss"), bwd("fc")),
        ("grad:pool", 2 * 8 * 4, bwd("fc"), bwd("pool")),
        # the stem's gradient is a slice of the concatenation's: the whole buffer stays until the conv's
        # backward step adds the stem's other part, which (the slice being no buffer of its own) takes the sum
        ("grad:cat", 2 * fmap, bwd("pool"), bwd("conv")),
        ("grad:conv", fmap, bwd("relu"), bwd("conv")),
        ("grad:stem", fmap, bwd("conv"), bwd("stem")),
    ]


class Block(nn.Module):
    """conv, batch-norm, add the input, ReLU in place (a residual block), or concatenate it (a dense layer)."""

    def __init__(self, cin: int, c: int, join: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.join = join

    def forward(self, x):
        if self.join == "add":
            return torch.relu_(self.bn(self.conv(x)) + x)
        return torch.cat([x, torch.relu(self.bn(self.conv(x)))], 1)


def _net(join: str, c: int = 16, blocks: int = 4) -> nn.Module:
    width = [c] * (blocks + 1) if join == "add" else [c * (k + 1) for k in range(blocks + 1)]
    return nn.Sequential(nn.Conv2d(3, c, 3, padding=1), *[Block(width[k], c, join) for k in range(blocks)],
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width[-1], 10))


@pytest.mark.parametrize("join", ["add", "concat"])
def test_plans_on_residual_and_dense_nets_reach_their_predicted_peaks_within_three_percent(join):
    # Counting one buffer per gradient put a residual net's recompute plans about a feature map (8%)
    # over the step, and a dense net's 4-11% over or under.
    torch.manual_seed(0)
    model = _net(join)
    x = torch.randn(8, 3, 16, 16)
    y = torch.randint(0, 10, (8,))
    everything = plan_memory(model, x, policy="checkpoint")
    for fraction in (1.0, 0.6):
        plan = plan_memory(model, x, memory_limit=int(everything.peak_bytes * fraction), policy="checkpoint")
        checked = check_plan(model, plan, x, y, steps=1)
        assert abs(checked.peak_ratio - 1) <= 0.03, (join, fraction, checked.peak_bytes, plan.peak_bytes)
