"""The float64 reference (`ucudnn.reference`) against torch's own convolutions, every form and kind.

Fresh random data per case; torch computes in float64 too (conv1d/2d/3d, conv_transpose1d/2d/3d and
their autograd gradients), so the two agree to float64 rounding or one of them is wrong.
"""

from __future__ import annotations

import numpy as np
import pytest
from conv_reference import FORMS, is_1d, torch_reference

from ucudnn.problem import KINDS, ConvProblem
from ucudnn.reference import reference, relative_error

torch = pytest.importorskip("torch")

INPUTS = {"fwd": ("x", "w"), "bwd_data": ("dy", "w"), "bwd_filter": ("x", "dy")}


def operands(problem: ConvProblem, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"x": problem.x_shape, "w": problem.w_shape, "dy": problem.y_shape}
    return {name: rng.standard_normal(shapes[name]) for name in INPUTS[problem.kind]}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", FORMS)
def test_reference_matches_torch(name: str, kind: str) -> None:
    problem = ConvProblem.parse(FORMS[name]).with_kind(kind)
    inputs = operands(problem, seed=hash((name, kind)) % 2**32)
    ours = reference(problem, **inputs)
    assert ours.shape == problem.out_shape
    theirs = torch_reference(problem, **inputs)
    assert relative_error(ours, theirs) < 1e-13, (name, kind)


def test_the_forms_cover_every_case() -> None:
    problems = [ConvProblem.parse(spec) for spec in FORMS.values()]
    assert {p.spatial_dims for p in problems} == {2, 3} and any(is_1d(p) for p in problems)
    for flag in ("transposed", "groups", "stride_h", "dilation_w", "pad_d", "output_padding_h"):
        assert any(getattr(p, flag) != getattr(ConvProblem(), flag) for p in problems), flag
    assert any(p.transposed and p.d for p in problems) and any(p.transposed and is_1d(p) for p in problems)


def test_the_comparison_sees_a_small_error() -> None:
    # Guard the check above: a filter off by 0.1% is far outside its tolerance.
    problem = ConvProblem.parse(FORMS["t3d_padded_grouped"])
    inputs = operands(problem, 0)
    assert (
        relative_error(reference(problem, x=inputs["x"], w=inputs["w"] * 1.001), torch_reference(problem, **inputs))
        > 1e-5
    )
