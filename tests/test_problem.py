import dataclasses

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


def test_key_holds_every_field_but_n():
    p = ConvProblem.parse("n=8,c=16,h=9,w=9,k=4,r=3,s=3")
    assert p.key == p.with_batch(64).key
    for field in dataclasses.fields(ConvProblem):
        if field.name in ("n",):
            continue
        changed = {"kind": "bwd_data", "dtype": "float16", "compute_type": "float64", "layout": "NHWC", "groups": 2}
        value = changed[field.name] if field.name in changed else getattr(p, field.name) + 1
        other = dataclasses.replace(p, **{field.name: value})
        assert other.key != p.key, field.name
    # An empty compute type means "the same as dtype".
    assert dataclasses.replace(p, compute_type="float32").key == p.key


def test_spec_round_trips():
    for spec in ("n=3,c=4,h=5,w=6,k=2,r=3,s=1,pad_h=1,pad_w=0,stride=2,groups=2",
                 "n=1,c=2,h=7,w=7,k=2,r=3,s=3,dilation=2,dtype=float64,kind=bwd_filter"):
        p = ConvProblem.parse(spec)
        assert ConvProblem.parse(p.spec) == p


@pytest.mark.parametrize("spec, words", [
    ("", "empty"),
    ("c=3,h=5,w=5,k=2,r=3", "missing s"),
    ("c=3,h=5,w=5,k=2,r=3,s=3,q=1", "unknown key 'q'"),
    ("c=3,h=5,w=5,k=2,r=3,s=x", "s must be an integer"),
    ("c=3,h=5,w=5,k=2,r=3,s=3,pad", "key=value"),
    ("c=0,h=5,w=5,k=2,r=3,s=3", "'c' must be positive"),
    ("c=3,h=5,w=5,k=2,r=3,s=3,pad=-1", "'pad_h' must be non-negative"),
    ("c=3,h=2,w=5,k=2,r=3,s=3", "larger than the padded input"),
    ("c=3,h=5,w=5,k=2,r=3,s=3,groups=2", "'groups' (2) must divide c (3)"),
    ("c=3,h=5,w=5,k=2,r=3,s=3,dtype=int8", "'dtype'"),
    ("c=3,h=5,w=5,k=2,r=3,s=3,layout=CHWN", "'layout'"),
    ("c=3,h=5,w=5,k=2,r=3,s=3,kind=bwd", "'kind'"),
    ("c=3,h=5,w=5,k=2,r=3,s=3,pad=1,pad_h=2", "given twice"),
])
def test_bad_specs_are_refused_with_the_field_named(spec, words):
    with pytest.raises(InvalidInput) as info:
        ConvProblem.parse(spec)
    assert words in str(info.value)
