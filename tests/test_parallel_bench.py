"""`ucudnn bench --workers N`: the same report as one worker, every row measured once."""

import json
import sqlite3

import pytest
from ucudnn.cli.main import main

from ucudnn.errors import InvalidInput, UcudnnError
from ucudnn.network.parallel import _work, partition, worker_environments
from ucudnn.problem import ConvProblem

LAYERS = ["--layer", "n=4,c=4,h=10,w=10,k=4,r=3,s=3,pad=1", "--layer", "n=4,c=4,h=6,w=6,k=8,r=1,s=1"]


def bench(tmp_path, capsys, db, *extra):
    code = main(
        ["bench", *LAYERS, "--backend", "cpu", "--reps", "1", "--json", "--quiet", "--db", str(tmp_path / db), *extra]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def rows(path):
    with sqlite3.connect(path) as con:
        return sorted(
            con.execute(
                "select p.key, m.algo, m.batch from measurements m join problems p on p.id = m.problem_id"
            ).fetchall()
        )


def test_workers_fill_the_cache_once_and_report_as_one_worker_would(tmp_path, capsys):
    parallel = bench(tmp_path, capsys, "w.db", "--workers", "2")
    single = bench(tmp_path, capsys, "s.db", "--exhaustive")
    # Workers time every candidate (each takes whole sizes, so none can prune by another's timings): the same
    # rows as one exhaustive worker measures: each once (the workers' measured count equals the rows stored).
    assert rows(tmp_path / "w.db") == rows(tmp_path / "s.db")
    assert parallel["benchmark"]["measured"] == len(rows(tmp_path / "w.db")) == single["benchmark"]["measured"]
    assert parallel["benchmark"]["cached"] == 0
    # A single worker replaying the workers' cache measures nothing and gives the identical report.
    replay = bench(tmp_path, capsys, "w.db", "--exhaustive")
    assert replay["benchmark"]["measured"] == 0
    assert {k: v for k, v in replay.items() if k != "benchmark"} == {
        k: v for k, v in parallel.items() if k != "benchmark"
    }
    # Same structure as the single-worker run on its own measurements.
    assert [k["layer"] + k["kind"] for k in parallel["kernels"]] == [k["layer"] + k["kind"] for k in single["kernels"]]


def test_bad_worker_count_exits_2(tmp_path, capsys):
    code = main(["bench", *LAYERS, "--backend", "cpu", "--workers", "0", "--db", str(tmp_path / "c.db")])
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--workers" in err


def test_worker_environments_give_one_gpu_each():
    envs = worker_environments(2, "cudnn", {"CUDA_VISIBLE_DEVICES": "3,5,7", "X": "1"})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3", "5"] and envs[0]["X"] == "1"
    assert [e["CUDA_VISIBLE_DEVICES"] for e in worker_environments(3, "cudnn", {}, gpu_count=4)] == ["0", "1", "2"]
    with pytest.raises(InvalidInput, match="needs one GPU per worker, but 2 are visible"):
        worker_environments(3, "cudnn", {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert worker_environments(2, "cpu", {"OMP_NUM_THREADS": "2"}) == [{"OMP_NUM_THREADS": "2"}] * 2
    with pytest.raises(InvalidInput):
        worker_environments(0, "cpu", {})


def test_partition_deals_every_unit_once_balanced_by_flops():
    p = ConvProblem(n=1, c=8, h=8, w=8, k=8, r=3, s=3, pad_h=1, pad_w=1)
    units = [(p, b) for b in (1, 2, 4, 8, 16)]
    shares = partition(units, 2)
    assert sorted(u for share in shares for u in share) == sorted(units)
    loads = [sum(b for _, b in share) for share in shares]
    assert sorted(loads) == [15, 16]  # 16 alone, 8+4+2+1 on the other


def test_a_worker_on_another_device_refuses(tmp_path):
    spec = {
        "backend": "cpu",
        "db": str(tmp_path / "c.db"),
        "algos": None,
        "reps": 1,
        "workspace_limit": None,
        "expect": {"device": "elsewhere", "backend": "cpu", "versions": "x"},
        "units": [],
    }
    with pytest.raises(UcudnnError, match="needs devices of one model"):
        _work(spec)
