"""The training graph: zoo networks with their layers between convs, and torch.fx tracing against the zoo."""

import pytest

from ucudnn.errors import InvalidInput
from ucudnn.memory.graph import from_network, trace
from ucudnn.network.zoo import layers

ZOO = ["alexnet", "vgg16", "resnet18", "resnet50", "resnet152", "densenet40", "googlenet"]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_graph_runs_every_zoo_conv_with_its_problem(name):
    g = from_network(name, 4)
    convs = {op.name: op.conv for op in g.conv_ops}
    assert convs == {layer.name: layer.problem for layer in layers(name, 4)}
    # every step reads only what an earlier step (or a write of its own) produced
    seen = set()
    for step in g.steps:
        for r in step.reads:
            assert r in seen or r in step.writes, (step, r)
        seen.update(step.writes)


def test_vgg16_feature_maps_by_hand():
    g = from_network("vgg16", 1)
    # conv outputs (ReLU in place) + pool outputs + image + fc outputs, float32
    convs = 2 * 224 * 224 * 64 + 2 * 112 * 112 * 128 + 3 * 56 * 56 * 256 + 3 * 28 * 28 * 512 + 3 * 14 * 14 * 512
    pools = 112 * 112 * 64 + 56 * 56 * 128 + 28 * 28 * 256 + 14 * 14 * 512 + 7 * 7 * 512
    expected = 4 * (convs + pools + 3 * 224 * 224 + 4096 + 4096 + 1000 + 1)
    assert g.feature_map_bytes == expected
    # the conv's backward reads its input; relu writes in place into the conv's storage
    assert g.storage_of("relu1_1") == "conv1_1"
    bwd = [s for s in g.steps if s.phase == "bwd" and s.op == "conv1_2"][0]
    assert "conv1_1" in bwd.reads and bwd.kernels == ("bwd_data", "bwd_filter")
    first = [s for s in g.steps if s.phase == "bwd" and s.op == "conv1_1"][0]
    assert first.kernels == ("bwd_filter",)  # the image needs no gradient


def test_googlenet_forks_and_joins():
    g = from_network("googlenet", 2)
    readers = [op.name for op in g.ops if "pool4" in op.inputs]
    assert len(readers) == 4  # the fork: the pool before 4a feeds its four branches
    assert g.op("inception4a.output").type == "concat" and len(g.op("inception4a.output").inputs) == 4


def test_bad_inputs():
    with pytest.raises(InvalidInput):
        from_network("nope", 4)
    with pytest.raises(InvalidInput):
        from_network("vgg16", 0)
    with pytest.raises(InvalidInput):
        from_network("deepbench", 4)


def _torch_resnet50():
    """ResNet-50 as the zoo has it: the stride on each stage's first 1x1, projection shortcuts."""
    from torch import nn

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
                self.downsample = nn.Sequential(nn.Conv2d(c_in, 4 * width, 1, stride=stride, bias=False),
                                                nn.BatchNorm2d(4 * width))

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
                width = 64 * 2 ** stage
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


def test_fx_resnet50_equals_zoo_resnet50():
    torch = pytest.importorskip("torch")
    model = _torch_resnet50().eval()
    traced = trace(model, torch.randn(2, 3, 224, 224))
    zoo = from_network("resnet50", 2)
    assert traced.batch == 2
    assert traced.feature_map_bytes == zoo.feature_map_bytes
    assert traced.weight_bytes == zoo.weight_bytes
    assert [op.conv for op in traced.conv_ops] == [op.conv for op in zoo.conv_ops] or \
        sorted(map(str, (op.conv for op in traced.conv_ops))) == sorted(map(str, (op.conv for op in zoo.conv_ops)))
    assert len(traced.storages) == len(zoo.storages)
    # a feature map is named after its fx node
    assert "layers_0_conv1" in {op.name for op in traced.ops}
    # in-place ReLU and `out += identity` share their input's storage
    assert traced.storage_of("layers_0_relu") != "layers_0_relu"


def test_fx_graph_plans_like_a_zoo_graph():
    torch = pytest.importorskip("torch")
    from torch import nn

    from ucudnn.memory import make_plan

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16 * 16, 10))
    g = trace(model, torch.randn(4, 3, 32, 32))
    assert [op.type for op in g.ops] == ["input", "conv", "relu", "pool", "conv", "relu", "view", "linear", "loss"]
    assert g.op("_1").inplace is False  # nn.ReLU() without inplace writes new memory
    plan = make_plan(g, "k40", 2**30, "vdnn-all")
    assert {t.name for t in plan.tensors} == set(g.storages)


def test_fx_functional_calls_fork_and_join():
    torch = pytest.importorskip("torch")
    from torch import nn
    from torch.nn import functional as F

    from ucudnn.memory import make_plan

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

    g = trace(Fork(), torch.randn(2, 3, 16, 16))
    types = {op.name: (op.type, op.inplace) for op in g.ops}
    assert types["relu"] == ("relu", False) and types["relu_1"] == ("relu", True)
    assert types["cat"] == ("concat", False) and types["max_pool2d"] == ("pool", False)
    assert g.op("cat").inputs == ("relu", "relu_1") and g.storage_of("relu_1") == "b"
    assert g.storage_of("view") == "max_pool2d"
    plan = make_plan(g, "k40", 2**30, "vdnn-all")
    actions = {t.name: t.action for t in plan.tensors}
    assert actions["a"] == "release"  # the conv output feeds a ReLU that saves its own output
    assert actions["relu"] == "offload"


def test_fx_every_output_feeds_the_loss_and_a_dead_branch_has_no_backward():
    torch = pytest.importorskip("torch")
    from torch import nn

    from ucudnn.memory import make_plan

    class Heads(nn.Module):
        """Two heads returned in a dict (the loss may read both) and a conv whose result nobody uses."""

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

    g = trace(Heads(), torch.randn(2, 3, 8, 8))
    assert set(g.op("loss").inputs) == {"fc", "aux"}
    backward = {s.op for s in g.steps if s.phase == "bwd"}
    assert {"aux", "sigmoid", "fc", "stem"} <= backward
    assert "grad:aux" in g.tensors and "grad:sigmoid" in g.tensors
    # autograd runs no backward step for a value the loss does not read
    assert "dead" not in backward and "grad:dead" not in g.tensors
    plan = make_plan(g, "k40", 2**30, "vdnn-all")
    assert {t.name for t in plan.tensors} == set(g.storages)
