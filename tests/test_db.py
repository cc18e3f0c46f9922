"""The cache API on SQLite and PostgreSQL: round trips, idempotence, keys, plans, info, prune."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from pg_server import db_url, pg_server  # noqa: F401
from ucudnn.db import SCHEMA_VERSION, Cache, default_url
from ucudnn.solver.types import MicroConfig

from ucudnn.errors import DatabaseError, InvalidInput
from ucudnn.problem import ConvProblem

DEVICE = {"device": "Test GPU 80GB", "backend": "cudnn", "versions": "cudnn=9.1.0,frontend=1.8"}
PROBLEM = ConvProblem.parse("n=32,c=64,h=56,w=56,k=128,r=3,s=3,pad=1,stride=1")
ALGOS = ("gemm", "implicit_gemm", "fft", "winograd", "direct")
BATCHES = (1, 2, 4, 8, 16, 32)


def micros(algos=ALGOS, batches=BATCHES, scale: float = 1.0) -> list[MicroConfig]:
    """Distinct, exactly representable values, with one failed candidate per batch."""
    out = []
    for i, algo in enumerate(algos):
        for b in batches:
            if algo == "winograd" and b > 8:
                out.append(MicroConfig(algo, b, math.inf, 0, reason="unsupported: batch > 8"))
            else:
                out.append(
                    MicroConfig(
                        algo,
                        b,
                        scale * (0.125 * (i + 1) + b / 64),
                        1024 * b * i,
                        reason="noisy" if b == 1 else "",
                        spread=0.015625 * i,
                    )
                )
        # and nothing else: the fixture values are what the tests compare against
    return out


def same(a: MicroConfig, b: MicroConfig) -> bool:
    """Equality of every field, including those MicroConfig leaves out of ==."""
    return dataclasses.astuple(a) == dataclasses.astuple(b)


@pytest.fixture
def cache(db_url: str):  # noqa: F811
    with Cache(db_url) as c:
        yield c


def test_store_then_lookup_finds_everything(cache: Cache) -> None:
    ms = micros()
    assert cache.store(problem_key=PROBLEM.key, micros=ms, **DEVICE) == len(ms)
    found = cache.lookup(problem_key=PROBLEM.key, batches=BATCHES, **DEVICE)
    assert set(found) == {(m.algo, m.batch) for m in ms}
    for m in ms:
        got = found[m.algo, m.batch]
        assert same(got, m), (got, m)
    failed = found["winograd", 16]
    assert math.isinf(failed.time) and failed.time > 0 and not failed.usable
    assert failed.reason == "unsupported: batch > 8"


def test_store_is_idempotent_and_second_run_measures_nothing(cache: Cache) -> None:
    ms = micros()
    assert cache.store(problem_key=PROBLEM.key, micros=ms, **DEVICE) == len(ms)
    # What a second identical benchmark run does: look up, find everything, store nothing new.
    found = cache.lookup(problem_key=PROBLEM.key, batches=BATCHES, algos=ALGOS, **DEVICE)
    missing = [(a, b) for a in ALGOS for b in BATCHES if (a, b) not in found]
    assert missing == []
    assert cache.store(problem_key=PROBLEM.key, micros=ms, **DEVICE) == 0
    assert cache.info()["measurements"] == len(ms)


def test_store_keeps_first_unless_replace(cache: Cache) -> None:
    first = [MicroConfig("gemm", 4, 1.5, 100, spread=0.25)]
    second = [MicroConfig("gemm", 4, 2.5, 200, reason="remeasured", spread=0.5)]
    cache.store(problem_key=PROBLEM.key, micros=first, **DEVICE)
    assert cache.store(problem_key=PROBLEM.key, micros=second, **DEVICE) == 0
    got = cache.lookup(problem_key=PROBLEM.key, batches=[4], **DEVICE)["gemm", 4]
    assert same(got, first[0])
    assert cache.store(problem_key=PROBLEM.key, micros=second, replace=True, **DEVICE) == 1
    got = cache.lookup(problem_key=PROBLEM.key, batches=[4], **DEVICE)["gemm", 4]
    assert same(got, second[0])
    assert cache.info()["measurements"] == 1


def test_lookup_filters_batches_and_algos(cache: Cache) -> None:
    cache.store(problem_key=PROBLEM.key, micros=micros(), **DEVICE)
    found = cache.lookup(problem_key=PROBLEM.key, batches=[2, 8, 64], algos=["fft", "nope"], **DEVICE)
    assert sorted(found) == [("fft", 2), ("fft", 8)]
    everything = cache.lookup(problem_key=PROBLEM.key, batches=None, **DEVICE)
    assert len(everything) == len(ALGOS) * len(BATCHES)
    assert cache.lookup(problem_key=PROBLEM.key, batches=[], **DEVICE) == {}
    assert cache.lookup(problem_key=PROBLEM.key, batches=iter([1]), algos=iter(["gemm"]), **DEVICE).keys() == {
        ("gemm", 1)
    }


def test_lookup_of_many_batches_spans_statements(cache: Cache) -> None:
    ms = [MicroConfig("gemm", b, float(b), b) for b in range(1, 1201)]
    assert cache.store(problem_key=PROBLEM.key, micros=ms, **DEVICE) == 1200
    assert len(cache.lookup(problem_key=PROBLEM.key, batches=range(1, 1300), **DEVICE)) == 1200


@pytest.mark.parametrize(
    "field, value",
    [
        ("device", "Other GPU 40GB"),
        ("backend", "cpu"),
        ("versions", "cudnn=9.2.0,frontend=1.8"),
        ("versions", "cudnn=9.1.0,frontend=1.9"),
    ],
)
def test_other_device_backend_or_versions_never_match(cache: Cache, field: str, value: str) -> None:
    cache.store(problem_key=PROBLEM.key, micros=micros(), **DEVICE)
    assert cache.lookup(problem_key=PROBLEM.key, batches=BATCHES, **{**DEVICE, field: value}) == {}


@pytest.mark.parametrize(
    "change",
    [
        {"dilation_h": 2, "dilation_w": 2},
        {"dilation_w": 2},
        {"groups": 2},
        {"dtype": "float16"},
        {"compute_type": "float64"},
        {"layout": "NHWC"},
        {"kind": "bwd_data"},
        {"kind": "bwd_filter"},
        {"pad_h": 0},
        {"stride_w": 2},
        {"c": 32},
    ],
)
def test_problem_differing_in_one_field_never_matches(cache: Cache, change: dict) -> None:
    other = dataclasses.replace(PROBLEM, **change)
    assert other.key != PROBLEM.key
    cache.store(problem_key=PROBLEM.key, micros=micros(), **DEVICE)
    assert cache.lookup(problem_key=other.key, batches=BATCHES, **DEVICE) == {}
    # ... and the reverse: storing under the other key leaves the first untouched.
    cache.store(problem_key=other.key, micros=micros(scale=2.0), **DEVICE)
    assert all(
        same(m, cache.lookup(problem_key=PROBLEM.key, batches=[m.batch], **DEVICE)[m.algo, m.batch]) for m in micros()
    )


def test_batch_size_is_not_part_of_the_problem_key(cache: Cache) -> None:
    cache.store(problem_key=PROBLEM.with_batch(8).key, micros=micros(), **DEVICE)
    assert len(cache.lookup(problem_key=PROBLEM.with_batch(256).key, batches=BATCHES, **DEVICE)) == len(ALGOS) * len(
        BATCHES
    )


def test_problem_kind_is_recorded(cache: Cache) -> None:
    for kind in ("fwd", "bwd_data", "bwd_filter"):
        cache.store(problem_key=dataclasses.replace(PROBLEM, kind=kind).key, micros=micros(batches=(1,)), **DEVICE)
    kinds = {r.problem_key.split(",")[0] for r in cache.measurement_records()}
    assert kinds == {"kind=fwd", "kind=bwd_data", "kind=bwd_filter"}


@pytest.mark.parametrize(
    "bad, rule",
    [
        (MicroConfig("gemm", 0, 1.0, 0), "positive integer"),
        (MicroConfig("gemm", 1, math.nan, 0), "non-negative number"),
        (MicroConfig("gemm", 1, -1.0, 0), "non-negative number"),
        (MicroConfig("gemm", 1, -math.inf, 0), "non-negative number"),
        (MicroConfig("gemm", 1, 1.0, -5), "workspace"),
        (MicroConfig("gemm", 1, 1.0, 0, spread=math.nan), "spread"),
        (MicroConfig("", 1, 1.0, 0), "algo"),
        (("gemm", 1, 1.0, 0), "MicroConfig"),
    ],
)
def test_store_rejects_bad_measurements(cache: Cache, bad, rule: str) -> None:
    with pytest.raises(InvalidInput, match=rule):
        cache.store(problem_key=PROBLEM.key, micros=[bad], **DEVICE)
    assert cache.info()["measurements"] == 0


def test_store_rejects_duplicates_and_empty_keys(cache: Cache) -> None:
    twice = [MicroConfig("gemm", 1, 1.0, 0), MicroConfig("gemm", 1, 2.0, 0)]
    with pytest.raises(InvalidInput, match="both 'gemm' at batch 1"):
        cache.store(problem_key=PROBLEM.key, micros=twice, **DEVICE)
    with pytest.raises(InvalidInput, match="versions"):
        cache.store(problem_key=PROBLEM.key, micros=micros(), **{**DEVICE, "versions": ""})
    with pytest.raises(InvalidInput, match="problem_key"):
        cache.lookup(problem_key=" ", batches=[1], **DEVICE)
    with pytest.raises(InvalidInput, match="batches"):
        cache.lookup(problem_key=PROBLEM.key, batches=[0], **DEVICE)
    assert cache.store(problem_key=PROBLEM.key, micros=[], **DEVICE) == 0


def test_plans_round_trip_and_replace(cache: Cache) -> None:
    plan = {
        "mode": "WR",
        "config": [{"algo": "fft", "batch": 16, "time_ms": 0.1, "workspace": 3}],
        "baseline": None,
        "nested": {"ok": True, "list": [1, 2.5, "x"]},
    }
    assert cache.get_plan("wr:abc") is None
    cache.put_plan("wr:abc", plan)
    assert cache.get_plan("wr:abc") == plan
    cache.put_plan("wr:abc", {"mode": "WD"})
    assert cache.get_plan("wr:abc") == {"mode": "WD"}
    long_key = "k" * 10_000  # longer than any engine's index entry
    cache.put_plan(long_key, plan)
    assert cache.get_plan(long_key) == plan and cache.get_plan(long_key[:-1]) is None
    assert cache.info()["plans"] == 2


@pytest.mark.parametrize("plan", [{"t": math.inf}, {"f": object()}, ["not", "a", "dict"]])
def test_plans_must_be_json(cache: Cache, plan) -> None:
    with pytest.raises(InvalidInput, match="plan"):
        cache.put_plan("key", plan)
    assert cache.get_plan("key") is None


def test_info_counts(cache: Cache) -> None:
    cache.store(problem_key=PROBLEM.key, micros=micros(), **DEVICE)
    cache.store(
        problem_key=dataclasses.replace(PROBLEM, kind="bwd_data").key,
        micros=micros(batches=(1,)),
        **{**DEVICE, "versions": "cudnn=9.2"},
    )
    cache.put_plan("p", {"a": 1})
    info = cache.info()
    assert {k: info[k] for k in ("schema_version", "devices", "problems", "measurements", "plans")} == {
        "schema_version": SCHEMA_VERSION,
        "devices": 2,
        "problems": 2,
        "measurements": len(ALGOS) * (len(BATCHES) + 1),
        "plans": 1,
    }
    assert info["url"] == cache.url
    assert [d["measurements"] for d in info["by_device"]] == [len(ALGOS) * len(BATCHES), len(ALGOS)]


def test_prune_by_filters(cache: Cache) -> None:
    other = {**DEVICE, "versions": "cudnn=8.9"}
    cache.store(problem_key=PROBLEM.key, micros=micros(), **DEVICE)
    cache.store(problem_key=PROBLEM.key, micros=micros(), **other)
    cache.put_plan("p", {"a": 1})
    n = len(ALGOS) * len(BATCHES)
    assert cache.prune(versions="cudnn=8.9", dry_run=True) == {"measurements": n, "plans": 0}
    assert cache.info()["measurements"] == 2 * n
    assert cache.prune(versions="cudnn=8.9") == {"measurements": n, "plans": 0, "devices": 1, "problems": 0}
    assert cache.lookup(problem_key=PROBLEM.key, batches=BATCHES, **other) == {}
    assert len(cache.lookup(problem_key=PROBLEM.key, batches=BATCHES, **DEVICE)) == n
    assert cache.prune(older_than_days=1)["measurements"] == 0  # everything is new
    assert cache.prune(device=DEVICE["device"], older_than_days=0) == {
        "measurements": n,
        "plans": 0,
        "devices": 1,
        "problems": 1,
    }
    assert cache.prune(older_than_days=0)["plans"] == 1
    with pytest.raises(InvalidInput, match="--all"):
        cache.prune()
    with pytest.raises(InvalidInput, match="--all"):
        cache.prune(everything=True, backend="cudnn")
    cache.store(problem_key=PROBLEM.key, micros=micros(), **DEVICE)
    assert cache.prune(everything=True)["measurements"] == n
    assert cache.info()["devices"] == 0


def test_readonly_cache_refuses_writes(db_url: str) -> None:  # noqa: F811
    with Cache(db_url) as c:
        c.store(problem_key=PROBLEM.key, micros=micros(), **DEVICE)
    with Cache(db_url, readonly=True) as ro:
        assert len(ro.lookup(problem_key=PROBLEM.key, batches=BATCHES, **DEVICE)) == len(micros())
        with pytest.raises(DatabaseError, match="read-only"):
            ro.store(problem_key=PROBLEM.key, micros=micros(), **DEVICE)


def test_reopen_keeps_data(db_url: str) -> None:  # noqa: F811
    with Cache(db_url) as c:
        c.store(problem_key=PROBLEM.key, micros=micros(), **DEVICE)
    with Cache(db_url) as c:
        assert len(c.lookup(problem_key=PROBLEM.key, batches=BATCHES, **DEVICE)) == len(micros())


# ---- URLs --------------------------------------------------------------------------------------


def test_default_url_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("UCUDNN_DB", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_url() == f"sqlite:///{tmp_path / 'xdg' / 'ucudnn' / 'cache.db'}"
    assert (tmp_path / "xdg" / "ucudnn").is_dir()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_url() == f"sqlite:///{tmp_path / 'home' / '.cache' / 'ucudnn' / 'cache.db'}"
    monkeypatch.setenv("UCUDNN_DB", "postgresql+psycopg://u@h/db")
    assert default_url() == "postgresql+psycopg://u@h/db"


def test_default_url_folder_that_cannot_be_made(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    monkeypatch.delenv("UCUDNN_DB", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    with pytest.raises(DatabaseError, match="cannot create the cache folder"):
        default_url()


def test_cache_none_uses_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("UCUDNN_DB", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with Cache() as c:
        c.store(problem_key=PROBLEM.key, micros=micros(), **DEVICE)
    assert (tmp_path / "ucudnn" / "cache.db").stat().st_size > 0


def test_plain_path_and_in_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with Cache("relative.db") as c:
        assert c.url == f"sqlite:///{tmp_path / 'relative.db'}"
        c.store(problem_key=PROBLEM.key, micros=micros(), **DEVICE)
    with Cache(tmp_path / "relative.db") as c:
        assert c.info()["measurements"] == len(micros())
    with Cache("sqlite://") as c:
        c.store(problem_key=PROBLEM.key, micros=micros(), **DEVICE)
        assert c.info()["measurements"] == len(micros())


@pytest.mark.parametrize(
    "url, rule",
    [
        ("mysql://u@h/db", "SQLite or PostgreSQL"),
        ("", "non-empty"),
        ("not a url://x", "not a database URL"),
    ],
)
def test_bad_urls(url: str, rule: str) -> None:
    with pytest.raises(InvalidInput, match=rule):
        Cache(url)


def test_password_is_hidden(tmp_path: Path) -> None:
    with pytest.raises(DatabaseError) as info:
        Cache("postgresql+psycopg://user:s3cret@127.0.0.1:1/nodb")  # nothing listens on port 1
    assert "s3cret" not in str(info.value) and "***" in str(info.value)


@pytest.mark.postgres
def test_bare_postgresql_url_gets_psycopg(pg_server) -> None:  # noqa: F811
    url = pg_server.create_schema()
    assert url.startswith("postgresql+psycopg://")
    with Cache(url.replace("postgresql+psycopg://", "postgresql://")) as c:
        assert c.url.startswith("postgresql+psycopg://")
        assert c.store(problem_key=PROBLEM.key, micros=micros(), **DEVICE) == len(micros())


@pytest.mark.parametrize("kind", ["fwd", "bwd_data", "bwd_filter"])
def test_second_benchmark_run_measures_nothing(db_url: str, kind: str) -> None:  # noqa: F811
    """Issue 1 end to end: the CPU backend measures through the cache, twice."""
    from ucudnn.backends import get_backend
    from ucudnn.kernel.measure import measure_table

    backend = get_backend("cpu")
    problem = dataclasses.replace(ConvProblem.parse("n=4,c=3,h=8,w=8,k=4,r=3,s=3,pad=1"), kind=kind)
    with Cache(db_url) as c:
        first, stats1 = measure_table(backend, problem, [1, 2, 4], cache=c, reps=1)
    with Cache(db_url) as c:  # a new process would open it afresh too
        second, stats2 = measure_table(backend, problem, [1, 2, 4], cache=c, reps=1)
    assert stats1.measured > 0 and stats1.cached == 0
    assert stats2.measured == 0 and stats2.cached == stats1.measured
    assert {b: [dataclasses.astuple(m) for m in ms] for b, ms in first.items()} == {
        b: [dataclasses.astuple(m) for m in ms] for b, ms in second.items()
    }
