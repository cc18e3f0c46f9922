"""The correctness suite: its float64 reference, its verdicts, its report, and `ucudnn selftest`."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
from ucudnn.cli.main import main
from ucudnn.solver.types import MicroConfig

from ucudnn.backends.base import Backend, DeviceInfo, wall_clock_samples_ms
from ucudnn.kernel.selftest import (
    ALPHA,
    BETA,
    DEFAULT_PROBLEMS,
    TOLERANCE,
    micro_batches,
    run_selftest,
)
from ucudnn.problem import KINDS, ConvProblem
from ucudnn.reference import reference, relative_error, to_host_float64

PROBLEMS = [ConvProblem.parse(spec) for spec in DEFAULT_PROBLEMS]


def _operands(problem: ConvProblem, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal(problem.x_shape),
        "w": rng.standard_normal(problem.w_shape),
        "dy": rng.standard_normal(problem.y_shape),
    }


# ---- the reference ---------------------------------------------------------------------------
@pytest.mark.parametrize("problem", PROBLEMS, ids=DEFAULT_PROBLEMS)
def test_reference_kernels_are_adjoint(problem):
    # <conv(x, w), dy> = <x, dgrad(dy, w)> = <w, wgrad(x, dy)>: the three kernels are the same
    # bilinear form, so each pair checks the other's indexing, padding, stride, dilation and groups.
    ops = _operands(problem)
    y = reference(problem.with_kind("fwd"), x=ops["x"], w=ops["w"])
    dx = reference(problem.with_kind("bwd_data"), dy=ops["dy"], w=ops["w"])
    dw = reference(problem.with_kind("bwd_filter"), x=ops["x"], dy=ops["dy"])
    assert y.shape == problem.y_shape and dx.shape == problem.x_shape and dw.shape == problem.w_shape
    forward = float(np.sum(y * ops["dy"]))
    assert math.isclose(forward, float(np.sum(ops["x"] * dx)), rel_tol=1e-10)
    assert math.isclose(forward, float(np.sum(ops["w"] * dw)), rel_tol=1e-10)


@pytest.mark.parametrize("problem", PROBLEMS, ids=DEFAULT_PROBLEMS)
def test_reference_matches_torch(problem):
    pytest.importorskip("torch")
    from conv_reference import torch_reference  # conv1d/2d/3d and conv_transpose, gradients by autograd

    ops = _operands(problem, seed=1)
    for kind, inputs in (("fwd", ("x", "w")), ("bwd_data", ("dy", "w")), ("bwd_filter", ("x", "dy"))):
        given = {name: ops[name] for name in inputs}
        np.testing.assert_allclose(
            reference(problem.with_kind(kind), **given),
            torch_reference(problem.with_kind(kind), **given),
            rtol=1e-12,
            atol=1e-12,
        )


def test_relative_error_and_helpers():
    expected = np.array([1.0, -4.0, 2.0])
    assert relative_error(expected, expected) == 0.0
    assert relative_error(np.array([1.0, -3.0, 2.0]), expected) == 0.25
    assert relative_error(np.array([1.0, np.nan, 2.0]), expected) == math.inf
    assert relative_error(np.zeros(3), np.zeros(3)) == 0.0
    assert micro_batches(1) == (1,) and micro_batches(3) == (2, 1) and micro_batches(4) == (2, 2)
    bits = np.array([0x3F80, 0xC000], dtype=np.uint16)  # bfloat16 1.0 and -2.0
    assert to_host_float64(bits, "bfloat16").tolist() == [1.0, -2.0]
    assert to_host_float64(np.float16([0.5]), "float16").dtype == np.float64


# ---- verdicts, with a backend made of the reference itself -------------------------------------
class ReferenceBackend(Backend):
    """NumPy backend computing with `reference`; `fault` breaks one part of the contract."""

    name = "reference"

    def __init__(self, algos=("direct", "other"), fault=None, unsupported=()):
        self._algos, self._fault, self._unsupported = list(algos), fault, dict(unsupported)

    @property
    def device(self):
        return DeviceInfo("host", 0)

    def algorithms(self, problem):
        return list(self._algos)

    def unsupported_reason(self, problem, algo):
        return self._unsupported.get(algo)

    def workspace_size(self, problem, algo):
        return 0

    def run(self, problem, algo, *, x=None, w=None, dy=None, out, workspace, alpha=1.0, beta=0.0):
        result = reference(problem, x=x, w=w, dy=dy)
        if self._fault == "wrong" and algo == "other":
            result = result * 1.01
        if self._fault == "nan" and algo == "other":
            result[..., 0] = np.nan
        if self._fault == "alpha":
            alpha = 1.0
        if self._fault == "accumulate" and beta == 1.0:  # overwrite instead of accumulating micro-batches
            beta = 0.0
        out[...] = alpha * result + (beta * out if beta else 0.0)

    def empty_workspace(self, nbytes):
        return np.empty(nbytes, dtype=np.uint8)

    def random_operands(self, problem, seed=0):
        ops = {k: v.astype(problem.dtype) for k, v in _operands(problem, seed).items()}
        names = {"fwd": ("x", "w"), "bwd_data": ("dy", "w"), "bwd_filter": ("x", "dy")}[problem.kind]
        result = {name: ops[name] for name in names}
        result["out"] = np.zeros(problem.out_shape, dtype=problem.dtype)
        return result

    def time_run_ms(self, problem, algo, operands, workspace, reps, beta=0.0):
        return wall_clock_samples_ms(lambda: self.run(problem, algo, workspace=workspace, beta=beta, **operands), reps)


def test_a_correct_backend_passes_everything():
    report = run_selftest(ReferenceBackend(), dtype="float64")
    assert report.passed and report.count("fail") == report.count("skip") == 0
    assert report.count("pass") == len(DEFAULT_PROBLEMS) * len(KINDS) * 2
    for check in report.checks:
        assert check.micro_batches == micro_batches(ConvProblem.parse(check.problem).n)
        assert None not in (
            check.error_reference,
            check.error_alpha_beta,
            check.error_micro_reference,
            check.error_micro_undivided,
        )
        assert check.worst_error <= TOLERANCE["float64"]
    assert set(report.table()) == {"direct", "other"}
    assert {kind for row in report.table().values() for kind in row} == set(KINDS)


class Lenient(ReferenceBackend):
    """Its measurement accepts every algorithm: the selftest alone must catch what is wrong."""

    def measure(self, problem, algos, reps=3, *, accumulate=False):
        return [MicroConfig(a, problem.n, 1.0, 0) for a in algos]


@pytest.mark.parametrize("fault, failing", [("alpha", "error_alpha_beta"), ("accumulate", "error_micro_reference")])
def test_each_broken_part_of_the_contract_fails(fault, failing):
    report = run_selftest(Lenient(fault=fault), problems=DEFAULT_PROBLEMS[:2])
    assert not report.passed
    failed = [c for c in report.checks if c.status == "fail"]
    assert failed and all(getattr(c, failing) > c.tolerance for c in failed)
    if fault == "accumulate":  # only bwd_filter accumulates micro-batches
        assert {c.kind for c in failed} == {"bwd_filter"}


def test_an_algorithm_wrong_only_when_accumulating_is_excluded_where_it_would_accumulate():
    # eng70's bwd_filter on an H200 (2026-11-26): right undivided, wrong micro-batched. Measurement
    # verifies a micro-batch size with beta = 1 as run_configuration runs it, so the solvers never
    # see it there, the cache keeps the reason, and the selftest shows it excluded and passes.
    from ucudnn.db.cache import Cache

    from ucudnn.kernel.measure import measure_table

    class Cached(ReferenceBackend):  # a cache row names the library versions it was measured with
        device = DeviceInfo("host", 0, (("reference", "1"),))

    backend = Cached(fault="accumulate")
    report = run_selftest(backend, problems=DEFAULT_PROBLEMS[:2])
    assert report.passed
    excluded = [c for c in report.checks if c.status == "excluded"]
    assert excluded and {c.kind for c in excluded} == {"bwd_filter"}
    assert all("accumulating with beta = 1" in c.reason and "at micro-batch" in c.reason for c in excluded)
    problem = ConvProblem.parse(DEFAULT_PROBLEMS[0]).with_kind("bwd_filter")
    with Cache("sqlite://") as cache:
        table, _ = measure_table(backend, problem, [1, problem.n], cache=cache, reps=1)
        assert all(m.usable for m in table[problem.n])  # undivided: beta = 0, right
        assert all(not m.usable and "accumulating with beta = 1" in m.reason for m in table[1])
        again, stats = measure_table(backend, problem, [1, problem.n], cache=cache, reps=1)
        assert stats.measured == 0 and again == table  # the verdict is cached with its reason


def test_an_algorithm_reading_the_output_it_should_overwrite_is_rejected():
    # beta = 0 must not read `out`: measurement hands the verified run an output of NaN.
    class ReadsOutput(ReferenceBackend):
        def run(self, problem, algo, *, out, beta=0.0, **kwargs):
            before = out.copy()
            super().run(problem, algo, out=out, beta=beta, **kwargs)
            if algo == "other":
                out += 0.0 * before  # right on zeros, NaN on anything unwritten

    problem = ConvProblem.parse(DEFAULT_PROBLEMS[0])
    verdicts = {m.algo: m for m in ReadsOutput().measure(problem, ["direct", "other"], reps=1)}
    assert verdicts["direct"].usable
    assert not verdicts["other"].usable and verdicts["other"].reason.startswith("wrong result (rel. error")


@pytest.mark.parametrize("fault", ["wrong", "nan"])
def test_a_wrong_algorithm_the_measurement_rejects_is_excluded(fault):
    # "other" gives a wrong result; the measurement's verification rejects it too, so ucudnn never
    # chooses it: the suite shows it excluded and passes.
    report = run_selftest(ReferenceBackend(fault=fault), problems=DEFAULT_PROBLEMS[:2])
    assert report.passed and report.count("fail") == 0
    excluded = [c for c in report.checks if c.status == "excluded"]
    assert {c.algo for c in excluded} == {"other"} and len(excluded) == 2 * len(KINDS)
    assert all(c.reason.startswith("wrong result (rel. error") and c.error_reference > c.tolerance for c in excluded)
    assert "excluded fwd other on" in report.format()
    assert report.to_json()["summary"]["excluded"] == len(excluded)


def test_a_wrong_algorithm_the_measurement_accepts_fails():
    # The danger selftest exists for: a wrong result that verification would let through.
    report = run_selftest(Lenient(fault="wrong"), problems=DEFAULT_PROBLEMS[:1])
    assert not report.passed and {c.algo for c in report.checks if c.status == "fail"} == {"other"}


def test_unsupported_algorithms_are_skipped_even_when_nothing_runs():
    report = run_selftest(ReferenceBackend(unsupported={"other": "needs a bigger tile"}), problems=DEFAULT_PROBLEMS[:1])
    assert report.passed and report.count("skip") == 3
    assert all(c.reason == "needs a bigger tile" for c in report.checks if c.status == "skip")
    unrunnable = ReferenceBackend(algos=("other",), unsupported={"other": "no"})
    nothing = run_selftest(unrunnable, problems=DEFAULT_PROBLEMS[:1])
    # What a backend does not offer is skipped with its reason, never failed (the CLI exits 2
    # when nothing ran at all: tests/test_hostile_input.py).
    assert nothing.passed and nothing.count("fail") == 0
    assert [(c.algo, c.status, c.reason) for c in nothing.checks] == [("other", "skip", "no")] * 3


def test_report_table_and_json():
    report = run_selftest(ReferenceBackend(fault="nan"), problems=DEFAULT_PROBLEMS[:1])
    text = report.format()
    lines = text.splitlines()
    assert lines[1].split() == ["algorithm", *KINDS]
    assert any(line.startswith("direct") and line.count("pass") == 3 for line in lines)
    assert any(line.startswith("other") and line.count("excluded") == 3 for line in lines)
    assert "excluded fwd other" in text and "0 skipped" in text
    data = json.loads(json.dumps(report.to_json()))  # strictly valid JSON: no bare Infinity or NaN
    assert data["passed"] is True and data["summary"]["excluded"] == 3
    assert data["table"]["other"]["fwd"] == {"status": "excluded", "max_rel_error": "inf"}
    assert data["table"]["direct"]["bwd_filter"]["status"] == "pass"
    assert {c["kind"] for c in data["checks"]} == set(KINDS)
    assert data["tolerance"] == TOLERANCE["float32"]


def test_alpha_beta_constants_test_both_terms():
    assert ALPHA not in (0.0, 1.0) and BETA not in (0.0, 1.0)


# ---- the command --------------------------------------------------------------------------------
def test_cli_cudnn_without_gpu_exits_2_with_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupy", None)  # as on a machine without CuPy, whatever this one has
    assert main(["selftest", "--backend", "cudnn"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith("ucudnn: error: cupy is not installed")


def test_cli_exit_codes_follow_the_verdict(monkeypatch, capsys):
    import ucudnn.backends

    monkeypatch.setattr(ucudnn.backends, "get_backend", lambda name: ReferenceBackend())
    assert main(["selftest", "--layer", DEFAULT_PROBLEMS[0]]) == 0
    assert "6 passed, 0 failed" in capsys.readouterr().out
    monkeypatch.setattr(ucudnn.backends, "get_backend", lambda name: ReferenceBackend(fault="alpha"))
    assert main(["selftest", "--json", "--layer", DEFAULT_PROBLEMS[0]]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["summary"]["failed"] == 6
    assert captured.err.strip() == "ucudnn: failed: selftest: 6 of 6 checks failed on backend reference"
    # a wrong algorithm the measurement rejects is shown, and does not fail the run
    monkeypatch.setattr(ucudnn.backends, "get_backend", lambda name: ReferenceBackend(fault="wrong"))
    assert main(["selftest", "--layer", DEFAULT_PROBLEMS[0]]) == 0
    assert "3 passed, 0 failed, 3 excluded" in capsys.readouterr().out


def test_cli_selftest_on_the_cpu_backend_passes(capsys):
    pytest.importorskip("ucudnn.backends.cpu", reason="the cpu backend is not in this checkout yet")
    assert main(["selftest", "--backend", "cpu", "--json"]) == 0, capsys.readouterr().out
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] and data["backend"] == "cpu" and data["summary"]["failed"] == 0
    assert {kind for row in data["table"].values() for kind in row} == set(KINDS)
