"""A damaged cache row is data, not a traceback (issue 51): a measurement or plan that breaks a rule is ignored as
missing with one warning naming the cache, the key and the rule, measured or planned again, and replaced; the next
run is silent. `ucudnn db check` lists such rows and `ucudnn db prune --invalid` removes them."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
from pg_server import db_url, pg_server  # noqa: F401
from sqlalchemy import create_engine, text
from ucudnn.cli.main import main
from ucudnn.db import Cache
from ucudnn.db.rows import row_error
from ucudnn.solver.types import MicroConfig

from ucudnn.problem import ConvProblem

torch = pytest.importorskip("torch")

LAYER = "n=4,c=4,h=6,w=6,k=4,r=3,s=3,pad=1"
# under a limit that every algorithm fits, so that a row's workspace is checked against the algorithm's as it is read
BENCH = ["bench", "--layer", LAYER, "--backend", "cpu", "--reps", "1", "--policy", "undivided", "--kinds", "fwd", "-q"]
BENCH += ["--workspace", "1MiB"]
# Each rule a measurement row can break, as SQL on the one row of im2col_gemm.
MEASUREMENT_POISON = {
    "time as text": ("time_ms = 'NaN'", "time_ms must be"),
    "negative time": ("time_ms = -3", "time_ms must be"),
    "negative workspace": ("workspace_bytes = -1", "workspace_bytes must be"),
    "no time, no reason": ("time_ms = NULL, reason = ''", "must record its reason"),
    "lying zero workspace": ("workspace_bytes = 0", "B it needs"),
}


def _damaged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]


def _sql(db: Path, statement: str) -> list:
    engine = create_engine(f"sqlite:///{db}")
    try:
        with engine.begin() as conn:
            result = conn.execute(text(statement))
            return result.all() if result.returns_rows else []
    finally:
        engine.dispose()


def _bench(capsys: pytest.CaptureFixture, db: Path) -> tuple[int, str]:
    code = main([*BENCH, "--db", str(db), "--json"])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out


@pytest.mark.parametrize("name", MEASUREMENT_POISON)
def test_a_poisoned_measurement_is_measured_again_and_replaced(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "c.db"
    assert _bench(capsys, db)[0] == 0
    change, rule = MEASUREMENT_POISON[name]
    _sql(db, f"UPDATE measurements SET {change} WHERE algo = 'im2col_gemm'")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ucudnn.db.cache"):
        code, out = _bench(capsys, db)
    assert code == 0
    (warning,) = _damaged(caplog)
    assert str(db) in warning and "'im2col_gemm' at batch 4" in warning and rule in warning, warning
    kernel = json.loads(out)["kernels"][0]
    assert kernel["time_ms"] > 0 and kernel["baseline"]["time_ms"] > 0 and kernel["workspace"] >= 0
    (row,) = _sql(db, "SELECT * FROM measurements WHERE algo = 'im2col_gemm'")
    assert row_error(row) is None and row.workspace_bytes > 0 and row.time_ms > 0  # replaced by a real measurement
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ucudnn.db.cache"):
        assert _bench(capsys, db)[0] == 0
    assert _damaged(caplog) == []


def test_a_lying_row_of_an_algorithm_over_the_limit_goes_once(
    tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """im2col_gemm needs about 23 KiB here: under a 4 KiB limit it is not run, so its lying row cannot be
    measured again; it is removed instead, and the next run is silent."""
    db = tmp_path / "c.db"
    limited = [*BENCH[:-1], "4KiB"]
    assert _bench(capsys, db)[0] == 0  # under 1 MiB: every algorithm measured
    _sql(db, "UPDATE measurements SET workspace_bytes = 0 WHERE algo = 'im2col_gemm'")
    for expected in (1, 0):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ucudnn.db.cache"):
            assert main([*limited, "--db", str(db), "--json"]) == 0
        kernel = json.loads(capsys.readouterr().out)["kernels"][0]
        assert len(_damaged(caplog)) == expected and kernel["workspace"] <= 4096
        assert kernel["config"][0]["algo"] != "im2col_gemm"
    assert _sql(db, "SELECT * FROM measurements WHERE algo = 'im2col_gemm'") == []


def _converted_run(db: Path, seed: int, **options: object) -> None:
    """A converted Conv2d on the cache, forward and backward, against PyTorch's own convolution in float64."""
    torch.manual_seed(seed)
    conv = torch.nn.Conv2d(4, 4, 3, padding=1)
    from ucudnn.torch import convert

    model = convert(torch.nn.Sequential(conv), backend="cpu", db=str(db), reps=1, policy="undivided", **options)
    if "total_workspace" in options:  # WD's first step registers the layers (torch computes it); the next is planned
        model(torch.randn(4, 4, 6, 6)).sum().backward()
        model.zero_grad(set_to_none=True)
    x = torch.randn(4, 4, 6, 6, requires_grad=True)
    model(x).square().sum().backward()
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, conv.weight, conv.bias))
    torch.nn.functional.conv2d(x64, w64, b64, padding=1).square().sum().backward()
    for got, want in ((x.grad, x64.grad), (conv.weight.grad, w64.grad), (conv.bias.grad, b64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["lying zero workspace", "time as text", "negative time"])
def test_a_converted_layer_replans_around_a_poisoned_measurement(
    name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No limit (default options): the solver's choice is what a lying workspace is checked by."""
    db = tmp_path / "c.db"
    only = {"algos": ["im2col_gemm"]}  # so that the plan runs the poisoned algorithm
    _converted_run(db, 0, **only)
    change, rule = MEASUREMENT_POISON[name]
    _sql(db, f"UPDATE measurements SET {change} WHERE algo = 'im2col_gemm'")
    _sql(db, "DELETE FROM plans")  # planned again from the measurements
    with caplog.at_level(logging.WARNING, logger="ucudnn.db.cache"):
        _converted_run(db, 1, **only)
    warnings = _damaged(caplog)
    assert len(warnings) == 3 and all(rule in w for w in warnings), warnings  # fwd, bwd_data, bwd_filter
    assert all(row_error(r) is None and r.workspace_bytes > 0 for r in _sql(db, "SELECT * FROM measurements"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ucudnn.db.cache"):
        _converted_run(db, 2, **only)
    assert _damaged(caplog) == []


# Each rule a stored WR plan can break, as a change of its JSON (the kernel's batch is 4).
PLAN_POISON = {
    "a field missing": (lambda p: p["config"][0].pop("workspace"), "lacks workspace"),
    "batch not a number": (lambda p: p["config"][0].update(batch="four"), "batch must be"),
    "config not a list": (lambda p: p.update(config={"algo": "native"}), "non-empty list"),
    "half the batch": (lambda p: p["config"][0].update(batch=2), "sum to 2 samples"),
    "workspace 0": (lambda p: p["config"][0].update(workspace=0, algo="im2col_gemm"), "B it needs"),
    "unknown algorithm": (lambda p: p["config"][0].update(algo="magic"), "not among the algorithms"),
}


@pytest.mark.parametrize("name", PLAN_POISON)
def test_a_poisoned_plan_is_planned_again_and_replaced(
    name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "c.db"
    _converted_run(db, 0)
    change, rule = PLAN_POISON[name]
    plans = _sql(db, "SELECT id, plan_json FROM plans")
    assert plans
    for plan_id, plan_json in plans:
        plan = json.loads(plan_json)
        change(plan)
        _sql(db, f"UPDATE plans SET plan_json = '{json.dumps(plan)}' WHERE id = {plan_id}")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ucudnn.db.cache"):
        _converted_run(db, 1)
    warnings = _damaged(caplog)
    assert len(warnings) == len(plans) and all(rule in w and str(db) in w for w in warnings), warnings
    for (plan_json,) in _sql(db, "SELECT plan_json FROM plans"):
        config = json.loads(plan_json)["config"]
        assert sum(m["batch"] for m in config) == 4 and all(m["workspace"] > 0 for m in config)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ucudnn.db.cache"):
        _converted_run(db, 2)
    assert _damaged(caplog) == []


WD_POISON = {
    "half the batch": (lambda k: k["config"][0].update(batch=2), "sum to 2 samples"),
    "kernel no object": (lambda k: k.clear(), "lacks"),
    "workspace 0": (lambda k: k["config"][0].update(workspace=0, algo="im2col_gemm"), "B it needs"),
}


@pytest.mark.parametrize("name", WD_POISON)
def test_a_poisoned_workspace_division_is_solved_again(
    name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "c.db"
    wd = {"total_workspace": 1 << 20}
    _converted_run(db, 0, **wd)
    change, rule = WD_POISON[name]
    ((plan_id, plan_json),) = _sql(db, "SELECT id, plan_json FROM plans")
    plan = json.loads(plan_json)
    assert plan["mode"] == "WD"
    change(plan["kernels"][0])
    _sql(db, f"UPDATE plans SET plan_json = '{json.dumps(plan)}' WHERE id = {plan_id}")
    with caplog.at_level(logging.WARNING, logger="ucudnn.db.cache"):
        _converted_run(db, 1, **wd)
    (warning,) = _damaged(caplog)
    assert "WD" in warning and (rule in warning or "kernel 0" in warning), warning
    ((plan_json,),) = _sql(db, "SELECT plan_json FROM plans")
    assert all(sum(m["batch"] for m in k["config"]) == 4 for k in json.loads(plan_json)["kernels"])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ucudnn.db.cache"):
        _converted_run(db, 2, **wd)
    assert _damaged(caplog) == []


def test_a_plan_that_is_no_json_is_a_missing_plan(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    db = tmp_path / "c.db"
    with Cache(db) as c:
        c.put_plan("k", {"x": 1})
    _sql(db, "UPDATE plans SET plan_json = '{not json'")
    with caplog.at_level(logging.WARNING, logger="ucudnn.db.cache"), Cache(db) as c:
        assert c.get_plan("k") is None
        assert c.get_plan("k") is None
    (warning,) = _damaged(caplog)
    assert "not JSON" in warning


KEY = ConvProblem(c=8, h=9, w=9, k=8, r=3, s=3, pad_h=1, pad_w=1).key
DEVICE = {"device": "Test GPU", "backend": "cpu", "versions": "numpy=2"}


def test_db_check_lists_damaged_rows_and_prune_invalid_removes_them(
    db_url: str,  # noqa: F811
    capsys: pytest.CaptureFixture,
    caplog: pytest.LogCaptureFixture,
) -> None:
    good = [MicroConfig(a, 1, 0.5, 64, reason="") for a in ("fft", "im2col_gemm", "shift_gemm")]
    with Cache(db_url) as c:
        c.store(problem_key=KEY, micros=good, **DEVICE)
        c.put_plan(
            "p", {"mode": "WR", "batch": 4, "config": [{"algo": "fft", "batch": 4, "time_ms": 1, "workspace": 0}]}
        )
        c.put_plan("fine", {"x": 1})
    assert main(["db", "check", "--db", db_url]) == 0
    assert "no damaged rows" in capsys.readouterr().out
    _execute(
        db_url,
        "UPDATE measurements SET workspace_bytes = -1 WHERE algo = 'fft'",
        "UPDATE measurements SET time_ms = 'NaN' WHERE algo = 'shift_gemm'",
        """UPDATE plans SET plan_json = '{"batch": 4, "config": [{"algo": "fft"}]}' WHERE key = 'p'""",
    )
    assert main(["db", "check", "--db", db_url, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert {(r["kind"], r["rule"].split(",")[0]) for r in report["damaged"]} == {
        ("measurement", "workspace_bytes must be a non-negative integer of bytes"),
        ("measurement", "time_ms must be a non-negative number of ms or +inf"),
        ("plan", "a micro-config lacks batch"),
    }
    assert main(["db", "check", "--db", db_url]) == 1
    table = capsys.readouterr().out
    assert table.startswith("kind") and "3 damaged rows" in table
    assert main(["db", "prune", "--db", db_url, "--invalid"]) == 0
    assert "removed 3 rows (2 measurements, 1 plans" in capsys.readouterr().out
    assert main(["db", "check", "--db", db_url]) == 0
    with Cache(db_url) as c:
        found = c.lookup(problem_key=KEY, batches=[1], **DEVICE)
        assert set(found) == {("im2col_gemm", 1)} and math.isfinite(found["im2col_gemm", 1].time)
        assert c.get_plan("fine") == {"x": 1}

    # Read, a damaged row is missing and warned once per cache object; where the cache can be written it goes.
    _execute(db_url, "UPDATE measurements SET time_ms = -2 WHERE algo = 'im2col_gemm'")
    for readonly, left in ((True, 1), (False, 0)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ucudnn.db.cache"), Cache(db_url, readonly=readonly) as c:
            for _ in range(2):
                assert c.lookup(problem_key=KEY, batches=[1], **DEVICE) == {}
            shown = c.url
        (warning,) = _damaged(caplog)
        assert shown in warning and "time_ms must be" in warning, warning
        assert main(["db", "check", "--db", db_url]) == left
        capsys.readouterr()


def _execute(url: str, *statements: str) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            for statement in statements:
                conn.execute(text(statement))
    finally:
        engine.dispose()


def test_prune_invalid_takes_no_other_filter(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    db = tmp_path / "c.db"
    Cache(db).close()
    assert main(["db", "prune", "--db", str(db), "--invalid", "--all"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--invalid" in err


def test_an_import_replaces_a_damaged_row_whatever_its_date(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    db, source = tmp_path / "c.db", tmp_path / "s.db"
    for path, time_ms in ((db, 0.5), (source, 0.75)):
        with Cache(path) as c:
            c.store(problem_key=KEY, micros=[MicroConfig("fft", 1, time_ms, 64)], **DEVICE)
    _sql(db, "UPDATE measurements SET time_ms = 'NaN', created_at = '2099-01-01 00:00:00.000000'")
    assert main(["db", "import", "--db", str(db), str(source), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["measurements"]["replaced"] == 1
    with Cache(db) as c:
        assert c.lookup(problem_key=KEY, batches=[1], **DEVICE)["fft", 1].time == 0.75
