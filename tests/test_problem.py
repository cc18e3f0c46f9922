import dataclasses
import math

import pytest

from ucudnn import ConvProblem
from ucudnn.errors import InvalidInput


def test_parse_sets_both_axes_and_single_axes():
    p = ConvProblem.parse("n=32,c=64,h=56,w=48,k=128,r=3,s=5,pad=1,stride=2,dilation_w=3,groups=2")
    assert (p.n, p.c, p.h, p.w, p.k, p.r, p.s) == (32, 64, 56, 48, 128, 3, 5)
    assert (p.pad_h, p.pad_w, p.stride_h, p.stride_w) == (1, 1, 2, 2)
    assert (p.dilation_h, p.dilation_w, p.groups) == (1, 3, 2)
    assert p.kind == "fwd" and p.dtype == "float32" and p.layout == "NCHW"


def test_output_shapes_follow_the_convolution_formula():
    p = ConvProblem.parse("n=2,c=3,h=227,w=227,k=96,r=11,s=11,stride=4")
    assert p.y_shape == (2, 96, 55, 55)
    p = ConvProblem.parse("n=1,c=4,h=700,w=161,k=8,r=20,s=5,pad_h=2,stride_w=2,dilation=2")
    # h: (700 + 4 - 39) // 1 + 1 = 666; w: (161 - 9) // 2 + 1 = 77
    assert p.y_shape == (1, 8, 666, 77)
    assert p.w_shape == (8, 4, 20, 5)
    assert p.with_kind("bwd_data").out_shape == p.x_shape
    assert p.with_kind("bwd_filter").out_shape == p.w_shape


# The key of a 2-D problem as the first release wrote it: caches hold rows under exactly this text.
FIRST_RELEASE_KEY = (
    "kind=bwd_filter,c=16,h=9,w=9,k=4,r=3,s=3,pad_h=1,pad_w=0,stride_h=2,stride_w=2,"
    "dilation_h=1,dilation_w=3,groups=2,dtype=float32,compute_type=float32,layout=NCHW"
)


def test_2d_keys_are_the_first_releases():
    p = ConvProblem.parse("n=8,c=16,h=9,w=9,k=4,r=3,s=3,pad_h=1,stride=2,dilation_w=3,groups=2,kind=bwd_filter")
    assert p.key == FIRST_RELEASE_KEY


def test_key_holds_every_field_but_n():
    p = ConvProblem.parse("n=8,c=16,h=9,w=9,k=4,r=3,s=3")
    deep = ConvProblem.parse("n=8,c=16,d=5,h=9,w=9,k=4,t=3,r=3,s=3,stride=2")
    assert p.key == p.with_batch(64).key
    changed = {
        "kind": "bwd_data",
        "dtype": "float16",
        "compute_type": "float64",
        "layout": "NHWC",
        "groups": 2,
        "transposed": True,
        "d": 4,
    }
    for field in dataclasses.fields(ConvProblem):
        if field.name in ("n",):
            continue
        # depth and output padding only exist on a 3-D (and transposed) problem
        base = p if field.name in changed or not field.name.endswith(("_d", "t")) else deep
        if field.name.startswith("output_padding"):
            base = dataclasses.replace(deep, transposed=True)
        value = changed[field.name] if field.name in changed else getattr(base, field.name) + 1
        other = dataclasses.replace(base, **{field.name: value})
        assert other.key != base.key, field.name
        assert ConvProblem.parse(other.key).key == other.key, field.name  # a key reads back
    # An empty compute type means "the same as dtype".
    assert dataclasses.replace(p, compute_type="float32").key == p.key


def test_spec_round_trips():
    for spec in (
        "n=3,c=4,h=5,w=6,k=2,r=3,s=1,pad_h=1,pad_w=0,stride=2,groups=2",
        "n=1,c=2,h=7,w=7,k=2,r=3,s=3,dilation=2,dtype=float64,kind=bwd_filter",
        "n=4,c=8,d=16,h=16,w=16,k=16,t=3,r=3,s=3,pad=1",
        "n=2,c=4,d=5,h=6,w=7,k=6,t=1,r=3,s=2,pad_d=1,stride_h=2,dilation_w=2,groups=2,layout=NHWC",
        "n=2,c=4,h=5,w=6,k=6,r=3,s=3,transposed=1,stride=2,output_padding_w=1,kind=bwd_data",
        "n=2,c=4,d=3,h=5,w=6,k=8,t=2,r=2,s=2,transposed=1,stride=2,output_padding=1",
    ):
        p = ConvProblem.parse(spec)
        assert ConvProblem.parse(p.spec) == p


@pytest.mark.parametrize(
    "spec, words",
    [
        ("", "empty"),
        ("c=3,h=5,w=5,k=2,r=3", "missing s"),
        ("c=3,h=5,w=5,k=2,r=3,s=3,q=1", "unknown key 'q'"),
        ("c=3,h=5,w=5,k=2,r=3,s=x", "s must be an integer"),
        ("c=3,h=5,w=5,k=2,r=3,s=3,pad", "key=value"),
        ("c=0,h=5,w=5,k=2,r=3,s=3", "c must be positive, got 0"),
        ("c=3,h=5,w=5,k=2,r=3,s=3,pad=-1", "pad must be non-negative, got -1"),
        ("c=3,h=5,w=5,k=2,r=3,s=3,stride_w=0", "stride_w must be positive, got 0"),
        ("c=3,h=2,w=5,k=2,r=3,s=3", "larger than the padded input"),
        ("c=3,h=5,w=5,k=2,r=3,s=3,groups=2", "groups (2) must divide c (3)"),
        ("c=3,h=5,w=5,k=2,r=3,s=3,dtype=int8", "dtype must be one of"),
        ("c=3,h=5,w=5,k=2,r=3,s=3,layout=CHWN", "layout must be one of"),
        ("c=3,h=5,w=5,k=2,r=3,s=3,kind=bwd", "kind must be one of"),
        ("c=3,h=5,w=5,k=2,r=3,s=3,pad=1,pad_h=2", "given twice"),
        ("c=3,h=5,w=5,k=2,r=3,s=3,t=3", "t (3) belongs to a depth axis"),
        ("c=3,h=5,w=5,k=2,r=3,s=3,pad_d=1", "give d (the input depth)"),
        ("c=3,d=0,h=5,w=5,k=2,r=3,s=3", "d must be positive"),
        ("c=3,h=5,w=5,k=2,r=3,s=3,output_padding=1", "transposed convolutions only"),
        ("c=3,h=5,w=5,k=2,r=3,s=3,transposed=1,stride=2,output_padding=2", "smaller than stride_h (2) or dilation_h"),
        ("c=3,h=5,w=5,k=2,r=3,s=3,transposed=1,dilation=3,output_padding=1", "cannot express it"),
        ("c=3,h=5,w=5,k=2,r=3,s=3,transposed=yes", "transposed must be 0 or 1"),
        ("c=3,h=1,w=1,k=2,r=1,s=1,pad=1,transposed=1", "transposed output would be"),
        ("c=3,d=2,h=5,w=5,k=2,t=3,r=3,s=3", "larger than the padded input (2x5x5)"),
    ],
)
def test_bad_specs_are_refused_with_the_field_named(spec, words):
    with pytest.raises(InvalidInput) as info:
        ConvProblem.parse(spec)
    assert words in str(info.value)
    # In the spec's words: the key as written, never the class's own name for it.
    assert "ConvProblem" not in str(info.value) and (not spec or str(info.value).startswith("layer spec"))


def test_a_problem_built_in_python_names_its_field():
    with pytest.raises(InvalidInput, match="ConvProblem field 'pad_h' must be non-negative, got -1"):
        ConvProblem(c=3, h=5, w=5, k=2, r=3, s=3, pad_h=-1)


def test_3d_shapes_and_pad_on_every_axis():
    p = ConvProblem.parse("n=4,c=8,d=16,h=16,w=16,k=16,t=3,r=3,s=3,pad=1")
    assert (p.pad_d, p.pad_h, p.pad_w) == (1, 1, 1) and p.spatial_dims == 3
    assert p.x_shape == (4, 8, 16, 16, 16) and p.w_shape == (16, 8, 3, 3, 3) and p.y_shape == (4, 16, 16, 16, 16)
    two = ConvProblem.parse("n=4,c=8,h=16,w=16,k=16,r=3,s=3,pad=1")
    assert two.spatial_dims == 2 and two.x_shape == (4, 8, 16, 16) and two.out_d == 0
    strided = ConvProblem.parse("n=1,c=2,d=9,h=8,w=7,k=4,t=3,r=2,s=1,pad_d=1,stride=2,dilation_d=2,groups=2")
    # d: (9 + 2 - 5) // 2 + 1 = 4; h: (8 - 2) // 2 + 1 = 4; w: (7 - 1) // 2 + 1 = 4
    assert strided.y_shape == (1, 4, 4, 4, 4) and strided.w_shape == (4, 1, 3, 2, 1)
    assert strided.with_kind("bwd_data").out_shape == strided.x_shape


def test_transposed_shapes_follow_pytorch():
    # ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2) on 5x4:
    # out = (5 - 1) * 2 - 2 + 3 + 1 = 10 and (4 - 1) * 2 - 2 + 3 + 1 = 8
    p = ConvProblem.parse("n=3,c=4,h=5,w=4,k=6,r=3,s=3,pad=1,stride=2,transposed=1,output_padding=1,groups=2")
    assert p.x_shape == (3, 4, 5, 4) and p.w_shape == (4, 3, 3, 3) and p.y_shape == (3, 6, 10, 8)
    assert p.with_kind("bwd_filter").out_shape == p.w_shape
    lowered = p.lowered()
    assert (lowered.kind, lowered.transposed, lowered.c, lowered.k) == ("bwd_data", False, 6, 4)
    assert lowered.x_shape == p.y_shape and lowered.y_shape == p.x_shape and lowered.w_shape == p.w_shape
    assert p.with_kind("bwd_data").lowered().kind == "fwd" and p.with_kind("bwd_filter").lowered().kind == "bwd_filter"
    assert ConvProblem.parse("c=2,h=5,w=5,k=2,r=3,s=3").lowered() == ConvProblem.parse("c=2,h=5,w=5,k=2,r=3,s=3")


def test_shapes_agree_with_torch_for_every_form():
    torch = pytest.importorskip("torch")
    from conv_reference import FORMS, is_1d

    F = torch.nn.functional
    for name, spec in FORMS.items():
        p = ConvProblem.parse(spec)
        x, w = torch.zeros(p.x_shape), torch.zeros(p.w_shape)
        axes = p.axes[1:] if is_1d(p) else p.axes
        if is_1d(p):
            x, w = x[:, :, 0], w[:, :, 0]
        args = {
            "stride": [a.stride for a in axes],
            "padding": [a.pad for a in axes],
            "dilation": [a.dilation for a in axes],
            "groups": p.groups,
        }
        if p.transposed:
            y = getattr(F, f"conv_transpose{len(axes)}d")(x, w, output_padding=[a.output_padding for a in axes], **args)
        else:
            y = getattr(F, f"conv{len(axes)}d")(x, w, **args)
        shape = tuple(y.shape[:2]) + ((1,) if is_1d(p) else ()) + tuple(y.shape[2:])
        assert shape == p.y_shape, name


@pytest.mark.parametrize(
    "spec",
    [
        "n=3,c=4,h=9,w=8,k=6,r=3,s=2,pad_h=1,stride_h=2,groups=2",
        "n=2,c=3,d=5,h=6,w=5,k=4,t=3,r=3,s=3,pad=1,stride_d=2",
        "n=3,c=4,h=5,w=4,k=6,r=3,s=2,pad=1,stride=2,transposed=1,output_padding_h=1,groups=2",
        "n=2,c=4,d=3,h=4,w=3,k=8,t=2,r=2,s=2,stride=2,transposed=1",
    ],
)
def test_flops_count_every_multiply_add(spec):
    p = ConvProblem.parse(spec)
    # Each weight element meets one input element per output position (plain) or one output
    # element per input position (transposed), per sample.
    positions = math.prod(p.x_shape[2:] if p.transposed else p.y_shape[2:])
    assert p.flops == 2 * p.n * positions * math.prod(p.w_shape)
    assert all(p.with_kind(kind).flops == p.flops for kind in ("bwd_data", "bwd_filter"))


def test_from_shapes_builds_every_pytorch_form():
    one = ConvProblem.from_shapes((2, 3, 10), (4, 3, 5), stride=2, padding=1, dilation=(2,))
    assert one == ConvProblem.parse("n=2,c=3,h=1,w=10,k=4,r=1,s=5,pad_w=1,stride_w=2,dilation_w=2")
    three = ConvProblem.from_shapes(
        (2, 4, 5, 6, 7), (6, 2, 3, 1, 3), stride=(1, 2, 1), padding=(1, 0, 1), groups=2, kind="bwd_filter"
    )
    assert three == ConvProblem.parse(
        "n=2,c=4,d=5,h=6,w=7,k=6,t=3,r=1,s=3,pad_d=1,pad_h=0,pad_w=1,stride_h=2,groups=2,kind=bwd_filter"
    )
    up = ConvProblem.from_shapes(
        (1, 8, 4, 4, 4), (8, 2, 2, 2, 2), stride=2, groups=2, transposed=True, output_padding=(1, 0, 1)
    )
    assert up.k == 4 and up.w_shape == (8, 2, 2, 2, 2) and up.y_shape == (1, 4, 9, 8, 9)
    with pytest.raises(InvalidInput, match="does not take the 8 channels"):
        ConvProblem.from_shapes((1, 8, 4, 4), (8, 2, 2, 2), groups=2)  # a transposed weight, read as plain
    with pytest.raises(InvalidInput, match="3, 4 or 5 dimensions"):
        ConvProblem.from_shapes((1, 8), (8, 8))
    with pytest.raises(InvalidInput, match="one per spatial axis"):
        ConvProblem.from_shapes((1, 2, 5, 5), (2, 2, 3, 3), stride=(1, 1, 1))
