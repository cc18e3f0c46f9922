"""A training step captured as PyTorch runs it (`ucudnn.torch.capture`): the ops it ran and their names, what
autograd saved and when the backward pass read it, the buffers the backward pass held, what the program itself
held, on fake tensors and real ones, and the errors a model that cannot be captured gets."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn import functional as F

from ucudnn import InvalidInput, UnsupportedProblem
from ucudnn.memory import make_plan
from ucudnn.memory.graph import from_network
from ucudnn.torch import capture, convert, execute_plan, plan_memory
from ucudnn.torch.zoo import build


def _torch_resnet50():
    """ResNet-50 as the zoo has it: the stride on each stage's first 1x1, projection shortcuts."""

    class Bottleneck(nn.Module):
        def __init__(self, c_in, width, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(c_in, width, 1, stride=stride, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = nn.Conv2d(width, 4 * width, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(4 * width)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = None
            if stride != 1 or c_in != 4 * width:
                self.downsample = nn.Sequential(
                    nn.Conv2d(c_in, 4 * width, 1, stride=stride, bias=False), nn.BatchNorm2d(4 * width)
                )

        def forward(self, x):
            identity = x
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            if self.downsample is not None:
                identity = self.downsample(x)
            out += identity
            return self.relu(out)

    class ResNet50(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
            blocks, c = [], 64
            for stage, count in enumerate((3, 4, 6, 3)):
                width = 64 * 2**stage
                for i in range(count):
                    blocks.append(Bottleneck(c, width, 2 if stage > 0 and i == 0 else 1))
                    c = 4 * width
            self.layers = nn.Sequential(*blocks)
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(2048, 1000)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.avgpool(self.layers(x))
            return self.fc(x.flatten(1))

    return ResNet50()


def test_a_captured_resnet50_runs_the_zoos_convolutions_with_what_autograd_holds():
    model = _torch_resnet50()
    step = capture(model, torch.randn(2, 3, 224, 224))  # on fake tensors: nothing is computed
    graph, zoo = step.graph, from_network("resnet50", 2)
    assert step.fake and graph.batch == 2
    assert [op.conv for op in graph.conv_ops] == [op.conv for op in zoo.conv_ops]
    assert [op.module for op in graph.conv_ops][:2] == ["conv1", "layers.0.conv1"]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # batch-norm statistics: the zoo has none
    assert graph.weight_bytes == zoo.weight_bytes + buffers
    # named after the module and the operation; in-place ReLUs and `out += identity` write their input's storage
    assert graph.op("layers.0.conv1:conv").type == "conv"
    assert (
        graph.op("layers.0.relu:relu_").inplace
        and graph.storage_of("layers.0.relu:relu_") == "layers.0.bn1:native_batch_norm"
    )
    assert graph.op("layers.0:add_").inplace
    # a max-pool's int64 indices are a storage of their own, kept, and read by its backward step
    indices = "maxpool:max_pool2d_with_indices.1"
    assert graph.bytes_of(indices) == 8 * 2 * 64 * 56 * 56 and indices in graph.captured.pinned
    assert any(
        indices in s.reads for s in graph.steps if s.phase == "bwd" and s.op == "maxpool:max_pool2d_with_indices"
    )
    # every conv's backward step runs the kernels autograd ran: the first conv's input needs no gradient
    kernels = {s.op: s.kernels for s in graph.steps if s.phase == "bwd" and s.kernels}
    assert kernels["conv1:conv"] == ("bwd_filter",) and kernels["layers.0.conv1:conv"] == ("bwd_data", "bwd_filter")
    assert graph.captured.weight_grad_bytes == sum(p.numel() * 4 for p in model.parameters())
    plan = make_plan(graph, "k40", 2**30, "vdnn-all")
    assert {t.name for t in plan.tensors} == set(graph.storages)


class Fork(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 1)
        self.b = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x):
        y = torch.cat([F.relu(self.a(x)), F.relu(self.b(x), inplace=True)], 1)
        y = F.max_pool2d(y, 2)
        return self.fc(y.view(y.size(0), -1))


def test_functional_calls_fork_and_join_and_views_are_no_ops():
    g = capture(Fork(), torch.randn(2, 3, 16, 16)).graph
    types = {op.name: (op.type, op.inplace) for op in g.ops}
    assert types["relu"] == ("relu", False) and types["relu_"] == ("relu", True)
    assert types["cat"] == ("concat", False) and types["max_pool2d_with_indices"] == ("pool", False)
    assert g.op("cat").inputs == ("relu", "b:conv") and g.storage_of("relu_") == "b:conv"
    assert "view" not in types  # a view writes no memory: the linear reads the pool's storage
    assert g.op("fc:addmm").inputs == ("max_pool2d_with_indices",)
    plan = make_plan(g, "k40", 2**30, "vdnn-all")
    actions = {t.name: t.action for t in plan.tensors}
    assert actions["a:conv"] == "release"  # it feeds a ReLU that saves its own output
    assert actions["relu"] == "offload"


class Heads(nn.Module):
    """Two heads returned in a dict and a conv whose result nobody uses."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.aux = nn.Conv2d(8, 4, 3, padding=1)
        self.dead = nn.Conv2d(8, 4, 1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        self.dead(h)
        return {"out": self.fc(torch.flatten(h, 1)), "aux": self.aux(torch.sigmoid(h))}


def test_every_output_feeds_the_default_loss_and_a_dead_branch_has_no_backward_step():
    g = capture(Heads(), torch.randn(2, 3, 8, 8)).graph
    backward = {s.op for s in g.steps if s.phase == "bwd"}
    assert {"aux:conv", "sigmoid", "fc:addmm", "stem:conv"} <= backward
    assert "dead:conv" not in backward  # autograd runs no backward step for a value the loss does not read
    assert {op.type for op in g.ops[-3:]} == {"loss"}  # the sums of both heads, added
    plan = make_plan(g, "k40", 2**30, "vdnn-all")
    assert {t.name: t.action for t in plan.tensors}["dead:conv"] == "release"


class Holds(nn.Module):
    """A Python variable alive until the forward pass returns, and a tensor kept in an attribute."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.kept = None

    def forward(self, x):
        a = self.conv1(x)
        b = torch.tanh(self.conv2(torch.tanh(a)))
        self.kept = torch.sigmoid(b)  # the program holds it after the step
        return self.conv3(b) + 0 * a.sum()


def test_what_the_program_holds_is_seen_and_kept():
    graph = capture(Holds(), torch.randn(2, 3, 8, 8)).graph
    holds = {name: graph.steps[k] for name, k in graph.captured.holds}
    assert "sigmoid" in graph.captured.pinned  # alive after the step: no plan frees it
    assert holds["sigmoid"].phase == "bwd"
    # `a` is read by its tanh, then held by the frame until `a.sum()`: a reader autograd does not know of
    assert graph.op("conv1:conv").name in holds or graph.consumers("conv1:conv", "fwd")[-1] > 2
    plan = make_plan(graph, "k40", 1, "checkpoint")
    actions = {t.name: t.action for t in plan.tensors}
    assert actions["sigmoid"] == "keep"


def test_fake_and_real_captures_agree_and_leave_the_model_as_it_was():
    torch.manual_seed(0)
    model = build("resnet18", num_classes=10)
    state = copy.deepcopy(model.state_dict())
    x = torch.randn(2, 3, 32, 32)
    fake, real = capture(model, x), capture(model, x, fake=False)
    assert fake.fake and not real.fake
    assert [op.name for op in fake.graph.ops] == [op.name for op in real.graph.ops]
    assert [op.bytes for op in fake.graph.ops] == [op.bytes for op in real.graph.ops]
    assert fake.graph.steps[fake.graph.forward_steps :] == real.graph.steps[real.graph.forward_steps :]
    assert [(life.bytes, life.start, life.end) for life in fake.graph.captured.lives] == [
        (life.bytes, life.start, life.end) for life in real.graph.captured.lives
    ]
    for name, value in model.state_dict().items():  # batch-norm statistics did not move
        assert torch.equal(value, state[name]), name
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "criterion",
    [nn.functional.mse_loss, nn.functional.smooth_l1_loss, nn.functional.binary_cross_entropy, nn.functional.l1_loss],
)
def test_fake_and_real_captures_agree_on_a_loss_held_in_its_unreduced_buffer(criterion):
    """Some of PyTorch's CPU losses return a 0-dim view of their unreduced buffer (4 bytes on fake tensors): a
    fake capture counts the storage the real kernel returns."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Sigmoid())
    x, y = torch.randn(2, 3, 8, 8), torch.rand(2, 3, 8, 8)
    fake, real = (capture(model, x, loss=lambda out: criterion(out, y), fake=f) for f in (True, False))
    assert [op.bytes for op in fake.graph.ops] == [op.bytes for op in real.graph.ops]
    assert real.graph.ops[-1].bytes == criterion(model(x), y).untyped_storage().nbytes()


def test_a_converted_model_runs_on_fake_tensors_and_its_convolutions_are_ucudnns_operators():
    model = convert(build("resnet18", num_classes=10), backend="cpu", workspace_limit=2**20, db="sqlite://")
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = model(torch.empty(4, 3, 64, 64))  # was: ".numpy() is not supported for tensor subclasses"
    assert isinstance(out, FakeTensor) and out.shape == (4, 10)
    assert not any(conv._routes for conv in model.modules() if hasattr(conv, "_routes"))  # nothing planned
    step = capture(model, torch.randn(4, 3, 64, 64))
    convs = [op for op in step.ops if op.name.endswith(":conv")]
    assert convs and all(op.func is torch.ops.ucudnn.convolution.default for op in convs)
    plain = capture(build("resnet18", num_classes=10), torch.randn(4, 3, 64, 64))
    assert [op.conv for op in step.graph.conv_ops] == [op.conv for op in plain.graph.conv_ops]


def test_a_plan_for_a_batch_this_machine_cannot_hold_is_made_on_fake_tensors():
    model = build("resnet50", num_classes=1000)
    with FakeTensorMode() as mode:
        x = torch.empty(4096, 3, 224, 224)  # 2.3 GiB of input alone, 100s of GiB of feature maps
    assert x.fake_mode is mode
    plan = plan_memory(model, x, memory_limit="80GB", policy="checkpoint", device="h100")
    assert plan.capture.fake and plan.batch == 4096
    assert plan.peak_bytes > 100 * 2**30 and not plan.fits  # what the limit would have to be is reported
    assert any(t.action == "recompute" for t in plan.tensors)


def test_inputs_as_a_tuple_or_a_dict_and_a_loss_of_the_output():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, image, mask):
            return {"logits": self.conv(image) * mask, "loss": None}

    model = TwoInputs()
    image, mask = torch.randn(2, 3, 8, 8), torch.ones(2, 1, 8, 8)
    by_position = capture(model, (image, mask), loss=lambda out: out["logits"].square().mean())
    by_keyword = capture(model, {"mask": mask, "image": image}, loss=lambda out: out["logits"].square().mean())
    assert set(by_position.inputs) == {"image", "mask"} == set(by_keyword.inputs)
    assert [op.name for op in by_position.graph.ops] == [op.name for op in by_keyword.graph.ops]
    assert {op.name for op in by_position.graph.ops if op.type == "input"} == {"input:image", "input:mask"}
    loss_ops = [op.name for op in by_position.graph.ops if op.type == "loss"]
    assert loss_ops == ["loss:pow", "loss:mean"]  # the loss's own memory is counted


def test_errors_say_in_one_line_why_a_model_cannot_be_captured():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    x = torch.randn(2, 3, 8, 8)
    cases = [
        (lambda: capture("not a model", x), InvalidInput, "must be a torch.nn.Module"),
        (lambda: capture(model, "an image"), InvalidInput, "a tensor, a tuple"),
        (lambda: capture(model, torch.tensor(1.0)), InvalidInput, "batched tensor"),
        (lambda: capture(model, x, loss=lambda out: out), InvalidInput, "one-element tensor that requires grad"),
        (lambda: capture(model, x, loss=lambda out: out.detach().sum()), InvalidInput, "requires grad"),
        (lambda: capture(model, torch.randn(2, 5, 8, 8)), UnsupportedProblem, "capturing a training step of"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message) as got:
            call()
        assert "\n" not in str(got.value), str(got.value)
    with FakeTensorMode():
        fake = torch.empty(2, 3, 8, 8)
    with pytest.raises(InvalidInput, match="fake=False needs real example inputs"):
        capture(model, fake, fake=False)


class Custom(torch.autograd.Function):
    """A hand-written autograd Function: square, saving its input."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return 2 * x * dy


class Unusual(nn.Module):
    """A custom autograd Function, a forward hook that changes the output, in-place ops on a view and
    shape-based control flow: what torch.fx cannot trace."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 16, 3, padding=1)
        self.body = nn.Sequential(*[m for _ in range(4) for m in (nn.Conv2d(16, 16, 3, padding=1), nn.Tanh())])
        self.conv2.register_forward_hook(lambda m, i, out: out * 0.5)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        h = Custom.apply(self.conv1(x))
        if h.shape[-1] > 8:  # on the shape: fine on fake tensors
            h = F.max_pool2d(h, 2)
        h = self.conv2(h)
        h[:, :4].relu_()
        h = self.body(h)
        return self.fc(h.mean((2, 3)))


@pytest.mark.parametrize("policy", ["checkpoint", "optimal"])
def test_a_model_torch_fx_cannot_trace_is_captured_planned_and_trains_like_plain_pytorch(policy):
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))

    def train(plan=None):
        torch.manual_seed(0)
        model = Unusual()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            with execute_plan(model, plan) if plan is not None else torch.enable_grad() as stats:
                F.cross_entropy(model(x), y).backward()
            opt.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()]), stats

    torch.manual_seed(0)
    loss = lambda out: F.cross_entropy(out, y)
    peaks = [plan_memory(Unusual(), x, memory_limit=limit, policy=policy, loss=loss).peak_bytes for limit in (2**40, 1)]
    torch.manual_seed(0)
    plan = plan_memory(Unusual(), x, memory_limit=sum(peaks) // 2, policy=policy, loss=loss)
    assert plan.fits and any(t.action == "recompute" for t in plan.tensors)
    reference, _ = train()
    got, stats = train(plan)
    assert stats.recomputed > 0
    torch.testing.assert_close(got, reference, rtol=0, atol=0)
