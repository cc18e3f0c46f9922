"""The training graph of zoo networks, with their layers between convs (a captured PyTorch step's graph:
tests/test_capture.py)."""

import pytest

from ucudnn.errors import InvalidInput
from ucudnn.memory.graph import from_network
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
    bwd = next(s for s in g.steps if s.phase == "bwd" and s.op == "conv1_2")
    assert "conv1_1" in bwd.reads and bwd.kernels == ("bwd_data", "bwd_filter")
    first = next(s for s in g.steps if s.phase == "bwd" and s.op == "conv1_1")
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
