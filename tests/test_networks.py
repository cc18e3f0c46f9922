"""The network zoo: layer counts, shapes against the papers' tables, chaining, kernels, the CLI."""

from __future__ import annotations

import itertools
import json

import pytest

from ucudnn.errors import InvalidInput
from ucudnn.network.zoo import (
    DEFAULT_BATCH,
    DENSENET40_GROWTH,
    NETWORKS,
    Layer,
    canonical_name,
    kernels,
    layers,
    unique_problems,
)
from ucudnn.problem import KINDS, ConvProblem

BATCH = 4


def by_name(name: str, batch: int = BATCH) -> dict[str, ConvProblem]:
    return {layer.name: layer.problem for layer in layers(name, batch)}


def chw_in(p: ConvProblem) -> tuple[int, int, int]:
    return (p.c, p.h, p.w)


def chw_out(p: ConvProblem) -> tuple[int, int, int]:
    return (p.k, p.out_h, p.out_w)


# ---- the registry and the common contract ------------------------------------------------


EXPECTED_COUNTS = {
    "alexnet": 5,
    "vgg16": 13,
    "resnet18": 20,
    "resnet50": 53,
    "resnet152": 155,
    "densenet40": 39,
    "googlenet": 57,
    "unet3d": 18,
    "deepbench": 94,
}


def test_registry_names_and_descriptions():
    assert list(NETWORKS) == list(EXPECTED_COUNTS)
    for description in NETWORKS.values():
        assert isinstance(description, str) and description and "\n" not in description
    assert set(DEFAULT_BATCH) == set(NETWORKS)


@pytest.mark.parametrize("name,count", EXPECTED_COUNTS.items())
def test_layer_counts_and_contract(name, count):
    net = layers(name, BATCH)
    assert len(net) == count
    assert len({layer.name for layer in net}) == count  # names are unique
    for layer in net:
        assert isinstance(layer, Layer)
        assert layer.problem.kind == "fwd"
        assert layer.problem.n == BATCH
        assert layer.problem.h == layer.problem.w or name == "deepbench"


def test_layer_is_frozen_with_slots():
    layer = layers("alexnet", 1)[0]
    with pytest.raises(AttributeError):
        layer.name = "x"  # type: ignore[misc]
    assert not hasattr(layer, "__dict__")


def test_resnet_downsample_counts():
    for name, downsample in (("resnet18", 3), ("resnet50", 4), ("resnet152", 4)):
        names = [layer.name for layer in layers(name, 1)]
        assert sum(n.endswith(".downsample") for n in names) == downsample


def test_default_batches():
    for name, batch in DEFAULT_BATCH.items():
        if batch is None:
            continue
        assert {layer.problem.n for layer in layers(name)} == {batch}
    assert DEFAULT_BATCH["deepbench"] is None


@pytest.mark.parametrize("spelling", ["ResNet-50", "resnet_50", "RESNET50", "resnet 50"])
def test_name_spellings(spelling):
    assert canonical_name(spelling) == "resnet50"
    assert layers(spelling, 2) == layers("resnet50", 2)


def test_unknown_name_lists_known_names():
    with pytest.raises(InvalidInput) as info:
        layers("lenet")
    message = str(info.value)
    assert "lenet" in message
    for name in NETWORKS:
        assert name in message


@pytest.mark.parametrize("batch", [0, -3, True, 2.0, "8"])
def test_bad_batch(batch):
    with pytest.raises(InvalidInput, match="batch"):
        layers("alexnet", batch)


# ---- AlexNet (Caffe bvlc_alexnet deploy.prototxt) ----------------------------------------

# name: (c, h_in, k, r, pad, stride, groups, h_out)
ALEXNET = {
    "conv1": (3, 227, 96, 11, 0, 4, 1, 55),
    "conv2": (96, 27, 256, 5, 2, 1, 2, 27),
    "conv3": (256, 13, 384, 3, 1, 1, 1, 13),
    "conv4": (384, 13, 384, 3, 1, 1, 2, 13),
    "conv5": (384, 13, 256, 3, 1, 1, 2, 13),
}


def test_alexnet_matches_caffe():
    net = by_name("alexnet")
    assert list(net) == list(ALEXNET)
    for name, (c, h, k, r, pad, stride, groups, h_out) in ALEXNET.items():
        p = net[name]
        assert (p.c, p.h, p.w, p.k, p.r, p.s) == (c, h, h, k, r, r), name
        assert (p.pad_h, p.pad_w, p.stride_h, p.stride_w, p.groups) == (pad, pad, stride, stride, groups)
        assert (p.out_h, p.out_w) == (h_out, h_out), name
    # 3x3/2 max-pools after conv1 (55 -> 27) and conv2 (27 -> 13)
    assert net["conv1"].k == net["conv2"].c and net["conv2"].k == net["conv3"].c


# ---- VGG-16 (configuration D) ---------------------------------------------------------------

# name: (c, h_in, k)
VGG16 = {
    "conv1_1": (3, 224, 64),
    "conv1_2": (64, 224, 64),
    "conv2_1": (64, 112, 128),
    "conv2_2": (128, 112, 128),
    "conv3_1": (128, 56, 256),
    "conv3_2": (256, 56, 256),
    "conv3_3": (256, 56, 256),
    "conv4_1": (256, 28, 512),
    "conv4_2": (512, 28, 512),
    "conv4_3": (512, 28, 512),
    "conv5_1": (512, 14, 512),
    "conv5_2": (512, 14, 512),
    "conv5_3": (512, 14, 512),
}


def test_vgg16_matches_config_d():
    net = by_name("vgg16")
    assert list(net) == list(VGG16)
    for name, (c, h, k) in VGG16.items():
        p = net[name]
        assert (p.c, p.h, p.k, p.r, p.s, p.pad_h, p.stride_h) == (c, h, k, 3, 3, 1, 1), name
        assert chw_out(p) == (k, h, h)  # 3x3 pad 1 keeps the size
    assert chw_out(net["conv5_3"]) == (512, 14, 14)


def test_vgg16_chains():
    net = layers("vgg16", 1)
    for prev, cur in itertools.pairwise(net):
        c, h, w = chw_out(prev.problem)
        same_stage = prev.name.split("_")[0] == cur.name.split("_")[0]
        expected = (c, h, w) if same_stage else (c, h // 2, w // 2)  # 2x2/2 max-pool
        assert chw_in(cur.problem) == expected, cur.name


# ---- ResNets (He et al. 2016, Table 1; stride on the first 1x1) -----------------------------

# stage (layerS = the paper's conv{S+1}_x): output size, basic widths, bottleneck widths
RESNET_TABLE = {
    1: (56, (64, 64), (64, 64, 256)),
    2: (28, (128, 128), (128, 128, 512)),
    3: (14, (256, 256), (256, 256, 1024)),
    4: (7, (512, 512), (512, 512, 2048)),
}
RESNET_BLOCKS = {"resnet18": (2, 2, 2, 2), "resnet50": (3, 4, 6, 3), "resnet152": (3, 8, 36, 3)}


@pytest.mark.parametrize("name", RESNET_BLOCKS)
def test_resnet_matches_table_1_and_chains(name):
    net = by_name(name)
    bottleneck = name != "resnet18"
    conv1 = net["conv1"]
    assert (conv1.c, conv1.h, conv1.k, conv1.r, conv1.pad_h, conv1.stride_h) == (3, 224, 64, 7, 3, 2)
    assert chw_out(conv1) == (64, 112, 112)
    expected_names = ["conv1"]
    block_in = (64, 56, 56)  # after the 3x3/2 pad-1 max-pool
    for stage, count in enumerate(RESNET_BLOCKS[name], start=1):
        size, basic, bott = RESNET_TABLE[stage]
        widths = bott if bottleneck else basic
        filters = (1, 3, 1) if bottleneck else (3, 3)
        for b in range(count):
            prefix = f"layer{stage}.{b}"
            convs = [f"{prefix}.conv{i + 1}" for i in range(len(widths))]
            expected_names += convs
            x = block_in
            for i, conv in enumerate(convs):
                p = net[conv]
                assert chw_in(p) == x, conv
                assert (p.k, p.out_h, p.out_w) == (widths[i], size, size), conv
                assert p.r == p.s == filters[i]
                assert p.pad_h == filters[i] // 2
                # the stride sits on the block's first conv (the 1x1 in a bottleneck)
                assert p.stride_h == (2 if stage > 1 and b == 0 and i == 0 else 1), conv
                x = chw_out(p)
            shortcut = f"{prefix}.downsample"
            if block_in != x:
                expected_names.append(shortcut)
                d = net[shortcut]
                assert chw_in(d) == block_in and chw_out(d) == x
                assert (d.r, d.s, d.pad_h) == (1, 1, 0)
                assert d.stride_h == (2 if stage > 1 else 1)
            else:
                assert shortcut not in net
            block_in = x
    assert list(net) == expected_names
    # the network's last conv writes 7x7 x (2048 or 512) and nothing reads it
    last = list(net.values())[-1]
    assert chw_out(last) == ((2048, 7, 7) if bottleneck else (512, 7, 7))


def test_resnet50_original_placement_of_stride():
    net = by_name("resnet50")
    assert net["layer2.0.conv1"].stride_h == 2 and net["layer2.0.conv1"].r == 1
    assert net["layer2.0.conv2"].stride_h == 1 and net["layer2.0.conv2"].h == 28
    assert net["layer1.0.downsample"].stride_h == 1 and net["layer1.0.downsample"].k == 256
    assert chw_out(net["layer4.2.conv3"]) == (2048, 7, 7)
    assert list(net)[-1] == "layer4.2.conv3"


# ---- GoogLeNet (Szegedy et al. 2015, Table 1) -----------------------------------------------

# block: (input size, input depth, output depth, #1x1, #3x3 reduce, #3x3, #5x5 reduce, #5x5, pool proj)
GOOGLENET = {
    "3a": (28, 192, 256, 64, 96, 128, 16, 32, 32),
    "3b": (28, 256, 480, 128, 128, 192, 32, 96, 64),
    "4a": (14, 480, 512, 192, 96, 208, 16, 48, 64),
    "4b": (14, 512, 512, 160, 112, 224, 24, 64, 64),
    "4c": (14, 512, 512, 128, 128, 256, 24, 64, 64),
    "4d": (14, 512, 528, 112, 144, 288, 32, 64, 64),
    "4e": (14, 528, 832, 256, 160, 320, 32, 128, 128),
    "5a": (7, 832, 832, 256, 160, 320, 32, 128, 128),
    "5b": (7, 832, 1024, 384, 192, 384, 48, 128, 128),
}
BRANCHES = ("1x1", "3x3_reduce", "3x3", "5x5_reduce", "5x5", "pool_proj")


def test_googlenet_stem():
    net = by_name("googlenet")
    assert list(net)[:3] == ["conv1", "conv2.3x3_reduce", "conv2.3x3"]
    assert chw_in(net["conv1"]) == (3, 224, 224) and chw_out(net["conv1"]) == (64, 112, 112)
    assert net["conv1"].r == 7 and net["conv1"].stride_h == 2
    assert chw_in(net["conv2.3x3_reduce"]) == (64, 56, 56) and net["conv2.3x3_reduce"].r == 1
    assert chw_out(net["conv2.3x3_reduce"]) == (64, 56, 56)
    assert chw_in(net["conv2.3x3"]) == (64, 56, 56) and chw_out(net["conv2.3x3"]) == (192, 56, 56)


def test_googlenet_inception_blocks_match_table_1():
    net = by_name("googlenet")
    expected_names = ["conv1", "conv2.3x3_reduce", "conv2.3x3"]
    prev_out = (192, 56, 56)
    for block, (size, depth_in, depth_out, b1, b3r, b3, b5r, b5, pp) in GOOGLENET.items():
        names = [f"inception{block}.{branch}" for branch in BRANCHES]
        expected_names += names
        x = (depth_in, size, size)
        # the block's input is the previous concat, max-pooled 3x3/2 where the size halves
        assert depth_in == prev_out[0] and size in (prev_out[1], (prev_out[1] + 1) // 2)
        one, red3, three, red5, five, proj = (net[n] for n in names)
        for p, reads, k, r in (
            (one, x, b1, 1),
            (red3, x, b3r, 1),
            (three, (b3r, size, size), b3, 3),
            (red5, x, b5r, 1),
            (five, (b5r, size, size), b5, 5),
            (proj, x, pp, 1),
        ):
            assert chw_in(p) == reads
            assert chw_out(p) == (k, size, size)
            assert (p.r, p.s, p.stride_h, p.pad_h) == (r, r, 1, r // 2)
        assert b1 + b3 + b5 + pp == depth_out
        prev_out = (depth_out, size, size)
    assert list(net) == expected_names
    assert chw_in(net["inception3a.1x1"]) == (192, 28, 28)


# ---- DenseNet-40 (CIFAR, growth 40 as the issue asks) --------------------------------------


def test_densenet40_shapes_and_chain():
    k = DENSENET40_GROWTH
    assert k == 40
    net = by_name("densenet40")
    assert chw_in(net["conv0"]) == (3, 32, 32) and chw_out(net["conv0"]) == (16, 32, 32)
    expected_names = ["conv0"]
    c, size = 16, 32
    for block in (1, 2, 3):
        if block > 1:
            trans = net[f"trans{block - 1}"]
            expected_names.append(f"trans{block - 1}")
            assert chw_in(trans) == (c, size, size) and chw_out(trans) == (c, size, size)  # no compression
            assert trans.r == 1
            size //= 2  # 2x2/2 average pool
        for i in range(12):
            p = net[f"dense{block}.{i}"]
            expected_names.append(f"dense{block}.{i}")
            assert chw_in(p) == (c, size, size), f"dense{block}.{i}"
            assert chw_out(p) == (k, size, size) and (p.r, p.pad_h) == (3, 1)
            c += k
    assert list(net) == expected_names
    assert (net["trans1"].c, net["trans2"].c, c) == (16 + 12 * k, 16 + 24 * k, 16 + 36 * k)


# ---- DeepBench training set ------------------------------------------------------------------


def test_deepbench_rows_and_field_order():
    net = layers("deepbench")
    assert [layer.name for layer in net] == [f"deepbench.{i}" for i in range(94)]
    # DeepBench order is (w, h, c, n, k, filter_w, filter_h, pad_w, pad_h, stride_w, stride_h)
    first = net[0].problem  # (700, 161, 1, 4, 32, 20, 5, 0, 0, 2, 2)
    assert first == ConvProblem(n=4, c=1, h=161, w=700, k=32, r=5, s=20, stride_h=2, stride_w=2)
    assert (first.out_h, first.out_w) == (79, 341)  # which is deepbench.4's input: 341 x 79
    assert (net[4].problem.h, net[4].problem.w, net[4].problem.c) == (79, 341, 32)
    assert net[29].problem == ConvProblem(
        n=16, c=3, h=224, w=224, k=64, r=7, s=7, pad_h=3, pad_w=3, stride_h=2, stride_w=2
    )
    assert net[-1].problem == ConvProblem(n=16, c=2048, h=7, w=7, k=512, r=1, s=1)
    assert {layer.problem.n for layer in net} == {4, 8, 16, 32}


def test_deepbench_batch_override():
    assert {layer.problem.n for layer in layers("deepbench", 3)} == {3}
    own = layers("deepbench")
    assert [layer.problem.with_batch(3) for layer in own] == [layer.problem for layer in layers("deepbench", 3)]


# ---- kernels and unique problems ------------------------------------------------------------


def test_kernels_alexnet():
    ks = kernels("alexnet", 8)
    assert len(ks) == 15
    assert [name for name, _ in ks[:3]] == ["conv1"] * 3
    assert [p.kind for _, p in ks[:3]] == list(KINDS)
    for name, p in ks:
        assert p.n == 8 and p.with_kind("fwd") == by_name("alexnet", 8)[name]
    skipped = kernels("alexnet", 8, skip_first_bwd_data=True)
    assert len(skipped) == 14
    assert ("conv1", by_name("alexnet", 8)["conv1"].with_kind("bwd_data")) not in skipped
    assert ("conv2", by_name("alexnet", 8)["conv2"].with_kind("bwd_data")) in skipped


def test_kernels_kinds_and_deepbench():
    assert [p.kind for _, p in kernels("vgg16", 2, ("bwd_filter",))] == ["bwd_filter"] * 13
    assert len(kernels("vgg16", 2, "fwd")) == 13
    assert len(kernels("deepbench", None, skip_first_bwd_data=True)) == 94 * 3
    for bad in ((), ("fwd", "fwd"), ("forward",)):
        with pytest.raises(InvalidInput):
            kernels("alexnet", 2, bad)


def test_unique_problems_groups_by_key():
    net = layers("resnet50", 8)
    groups = unique_problems(net)
    assert sum(len(names) for names in groups.values()) == 53
    assert len(groups) < 53
    problems = {layer.name: layer.problem for layer in net}
    for key, names in groups.items():
        assert all(problems[n].key == key for n in names)
    # layer1.1 and layer1.2 are the same block
    key = problems["layer1.1.conv1"].key
    assert groups[key][:2] == ["layer1.1.conv1", "layer1.2.conv1"]
    # the first layer of each key comes in network order
    assert next(iter(groups.values())) == ["conv1"]
    # DeepBench repeats shapes at other batches; the key leaves the batch out
    db = unique_problems(layers("deepbench"))
    assert len(db) < 94
    assert db[layers("deepbench")[0].problem.key] == [f"deepbench.{i}" for i in range(4)]
    assert unique_problems([]) == {}


# ---- 3-D U-Net (Çiçek et al. 2016, Fig. 1) ------------------------------------------------------


def test_unet3d_matches_the_paper():
    net = by_name("unet3d", 1)
    # a 132x132x116 tile (x, y, z) of 3 channels in; 44x44x28 voxels of 3 labels out
    assert net["down1.conv1"].x_shape == (1, 3, 116, 132, 132)
    assert net["final"].y_shape == (1, 3, 28, 44, 44) and net["final"].w_shape == (3, 64, 1, 1, 1)
    convs = [p for name, p in net.items() if name != "final" and not name.endswith("upconv")]
    assert all((p.t, p.r, p.s, p.pad_d, p.pad_h, p.pad_w, p.transposed) == (3, 3, 3, 0, 0, 0, False) for p in convs)
    # analysis path: channels doubled before each max-pool
    assert [(net[f"down{i}.conv1"].k, net[f"down{i}.conv2"].k) for i in range(1, 5)] == [
        (32, 64),
        (64, 128),
        (128, 256),
        (256, 512),
    ]
    for i in range(1, 4):  # a 2x2x2 max-pool of stride 2 halves each axis between levels
        assert net[f"down{i + 1}.conv1"].x_shape[2:] == tuple(s // 2 for s in net[f"down{i}.conv2"].y_shape[2:])
    assert net["down4.conv2"].y_shape == (1, 512, 7, 9, 9)
    # synthesis path: 2x2x2 up-convolutions of stride 2 keep the channels; the concatenation adds the
    # analysis path's maps of the level (cropped)
    for level, channels, size in ((3, 512, (14, 18, 18)), (2, 256, (20, 28, 28)), (1, 128, (32, 48, 48))):
        up = net[f"up{level}.upconv"]
        assert (
            up.transposed and (up.t, up.r, up.s) == (2, 2, 2) and (up.stride_d, up.stride_h, up.stride_w) == (2, 2, 2)
        )
        assert up.c == up.k == channels and up.y_shape[2:] == size
        first = net[f"up{level}.conv1"]
        skip = net[f"down{level}.conv2"]
        assert first.c == channels + skip.k and first.k == skip.k and first.x_shape[2:] == size
        assert all(s >= u for s, u in zip(skip.y_shape[2:], size))  # the skip is cropped, never padded
    assert [net[f"up{level}.conv2"].k for level in (3, 2, 1)] == [256, 128, 64]


# ---- CLI -------------------------------------------------------------------------------------


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    from ucudnn.cli.main import main

    code = main(["networks", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_summary_json(capsys):
    code, out, err = run_cli(capsys, "--json", "--batch", "2")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert set(doc) == {"networks"}
    assert [e["name"] for e in doc["networks"]] == list(NETWORKS)
    for e in doc["networks"]:
        assert set(e) >= {"name", "description", "conv_layers", "unique_shapes", "gflops_fwd"}
        net = layers(e["name"], 2)
        assert e["description"] == NETWORKS[e["name"]]
        assert e["conv_layers"] == len(net) == EXPECTED_COUNTS[e["name"]]
        assert e["unique_shapes"] == len(unique_problems(net))
        assert e["gflops_fwd"] == pytest.approx(sum(layer.problem.flops for layer in net) / 1e9)
        assert e["batch"] == 2


def test_cli_summary_table(capsys):
    code, out, err = run_cli(capsys)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert len(lines) == 1 + len(NETWORKS)
    assert lines[1].split()[:3] == ["alexnet", "5", "5"]


def test_cli_one_network(capsys):
    code, out, _ = run_cli(capsys, "ResNet-18", "--json", "--batch", "3")
    assert code == 0
    doc = json.loads(out)
    assert doc["network"] == "resnet18" and doc["batch"] == 3
    assert len(doc["layers"]) == 20
    first = doc["layers"][0]
    assert first["name"] == "conv1" and first["output"] == [3, 64, 112, 112]
    assert ConvProblem.parse(first["spec"]) == layers("resnet18", 3)[0].problem
    code, out, _ = run_cli(capsys, "alexnet")
    assert code == 0 and "conv5" in out and "128x256x13x13" in out


@pytest.mark.parametrize("args", [("nope",), ("alexnet", "--batch", "0"), ("--batch", "-1")])
def test_cli_bad_input_exits_2_with_one_line(capsys, args):
    code, out, err = run_cli(capsys, *args)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
