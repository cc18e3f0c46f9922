"""What `plan_memory` does where its first answer would not do: a capture on fake tensors that the real step
does not run is taken again on the real inputs (Hugging Face's ConvBERT takes a fake tensor for a trace and skips
a padding check), and a limit below every plan gives the smallest plan there is, for every policy."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from plain_training import assert_trains_alike, train
from torch import nn
from torch.nn import functional as F

from ucudnn.errors import UnsupportedProblem
from ucudnn.memory.planner import POLICIES
from ucudnn.torch import execute_plan, measure_profile, plan_memory
from ucudnn.torch.planning import planner as planning
from ucudnn.torch.zoo import build

SEQ, BATCH, VOCAB, LABELS = 16, 2, 100, 3


def _convbert():
    """A tiny ConvBERT. Its embeddings are as wide as its layers: at the default 768, their weights and gradients
    make the peak (at the end of the backward pass), which no recomputation lowers."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ConvBertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        embedding_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=LABELS,
    )
    torch.manual_seed(0)
    return transformers.ConvBertForSequenceClassification(config)


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, LABELS, (BATCH,), generator=g)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_convbert_plans_with_default_arguments_on_its_real_step_and_trains_as_plain_pytorch():
    """The capture on fake tensors runs `aten.ones` where the real step indexes (transformers' `is_tracing()`):
    the timed steps find it, and the step is captured on the real inputs, once (the cache holds that capture)."""
    base = _convbert()
    ids, y = _batch(0)

    def loss(out):
        return F.cross_entropy(out.logits, y)

    model = copy.deepcopy(base)
    everything = plan_memory(model, ids, loss=loss)
    assert everything.capture.fake is False
    steps = planning._CAPTURES[model]
    assert len(steps) == 1 and not any(step.fake for step in steps.values())  # the real capture, for that key
    (step,) = steps.values()
    assert planning._captured(model, ids, loss, None, "backward")[1] is step
    smallest = plan_memory(model, {"input_ids": ids}, memory_limit=1, loss=loss)  # a dict: the same step
    assert smallest.capture.fake is False and smallest.peak_bytes < everything.peak_bytes
    plan = plan_memory(model, ids, memory_limit=(everything.peak_bytes + smallest.peak_bytes) // 2, loss=loss)
    assert plan.capture is step and plan.fits
    assert any(t.action == "recompute" for t in plan.tensors)
    probe = copy.deepcopy(base)
    with execute_plan(probe, plan) as stats:
        loss(probe(ids)).backward()
    assert stats.recomputed > 0

    reference = train(copy.deepcopy(base), _batch)
    noise = (reference - train(copy.deepcopy(base), _batch, threads=2)).norm().item()
    assert_trains_alike(train(model, _batch, plan), reference, noise)


def test_a_device_profile_checks_the_fake_capture_against_one_real_forward_pass(monkeypatch):
    """No real step runs where planning for a profile: one forward pass and the loss check the capture on fake
    tensors, once per capture, and leave the model as it was. A faithful capture stays on fake tensors."""
    follows = []
    follow = planning._follow
    monkeypatch.setattr(planning, "_follow", lambda *a: follows.append(a[1].fake) or follow(*a))
    model = _convbert()
    ids, _ = _batch(0)
    before, rng = _state(model), torch.get_rng_state()
    plan = plan_memory(model, ids, memory_limit=1, policy="checkpoint", device="k40")
    assert plan.capture.fake is False and follows == [True, False]  # the fake capture, then the real one
    assert not any(step.fake for step in planning._CAPTURES[model].values())
    assert torch.equal(torch.get_rng_state(), rng) and all(p.grad is None for p in model.parameters())
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    plan_memory(model, ids, memory_limit=1, policy="checkpoint", device="k40")
    assert len(follows) == 2  # followed once

    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 10),
    )
    before = _state(net)
    plan = plan_memory(net, torch.randn(2, 3, 8, 8), device="k40")
    assert plan.capture.fake is True and follows[2:] == [True]
    for name, value in net.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_fake_capture_the_user_asked_for_is_refused_in_one_line_that_says_to_pass_fake_false():
    model = _convbert()
    ids, _ = _batch(0)
    with pytest.raises(UnsupportedProblem, match="captured on fake tensors differs from the real step") as err:
        plan_memory(model, ids, fake=True)
    message = str(err.value)
    assert "\n" not in message and "fake=False" in message and "plan again" not in message
    assert "aten.ones" in message  # what differs: the operation captured, and the one the real step ran
    with pytest.raises(UnsupportedProblem, match="captured on fake tensors differs"):  # the same answer again
        plan_memory(model, ids, fake=True)
    assert plan_memory(model, ids, fake=False, device="k40").capture.fake is False


@pytest.mark.parametrize("device", ["cpu", "k40"])
def test_a_limit_below_every_plan_gives_each_policys_smallest_and_optimal_the_smallest_of_all(device):
    """ResNet-18: where nothing fits, each policy's plan is its least peak (no plan it makes at a higher limit is
    smaller), and optimal's is the least of all: its program solved for its least peak, below every heuristic's on
    the CPU (where nothing is offloaded), and below what it plans where only the program fits."""
    profile = measure_profile("cpu") if device == "cpu" else device
    torch.manual_seed(0)
    model = build("resnet18", num_classes=10)
    x = torch.randn(4, 3, 64, 64)
    smallest = {}
    for policy in POLICIES:
        everything = plan_memory(model, x, policy=policy, device=profile)
        least = plan_memory(model, x, memory_limit=1, policy=policy, device=profile)
        assert not least.fits and least.memory_limit == 1 and least.policy == policy
        for share in (0.25, 0.5, 0.75):
            limit = int(least.peak_bytes + share * (everything.peak_bytes - least.peak_bytes))
            assert (
                least.peak_bytes <= plan_memory(model, x, memory_limit=limit, policy=policy, device=profile).peak_bytes
            ), (policy, share)
        smallest[policy] = least.peak_bytes
    assert smallest["optimal"] == min(smallest.values()), smallest
    heuristics = min(peak for policy, peak in smallest.items() if policy != "optimal")
    below = plan_memory(model, x, memory_limit=heuristics - 1, policy="optimal", device=profile)
    assert smallest["optimal"] <= below.peak_bytes
    if device == "cpu":
        assert smallest["optimal"] < heuristics and below.fits, smallest


class Alternating(nn.Module):
    """A model whose every other call takes another branch: no capture is the next step's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.calls = nn.Linear(8, 8), nn.Linear(8, 8), 0

    def forward(self, x):
        self.calls += 1
        return torch.relu(self.a(x)) if self.calls % 2 else torch.sigmoid(self.b(x))


def test_a_real_capture_the_next_step_does_not_follow_is_taken_again_once_then_refused_without_plan_again():
    model = Alternating()
    with pytest.raises(UnsupportedProblem, match="runs otherwise from one step to the next") as err:
        plan_memory(model, torch.randn(4, 8), fake=False)
    assert "\n" not in str(err.value) and "plan again" not in str(err.value)
    assert model.calls == 4  # captured, diverged in the first timed step, captured again, diverged again
