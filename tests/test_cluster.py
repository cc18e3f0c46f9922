"""`ucudnn.best_batch_size` and `ucudnn cluster`: step times from the cache or a profile, and the CLI contract."""

import json

import pytest
from ucudnn.cli.main import main
from ucudnn.db import Cache
from ucudnn.solver import Infeasible
from ucudnn.solver.types import MicroConfig

import ucudnn
from ucudnn.errors import InvalidInput
from ucudnn.network.cluster import candidate_sizes, plan_cluster
from ucudnn.network.zoo import kernels

NETWORK = "alexnet"
MEASURED_SIZES = (1, 2, 4, 8, 16, 32)


def fill_cache(path, model, ms_per_sample, *, skip_keys=0):
    """Synthetic measurements of every AlexNet kernel on `model`: algorithm `gemm` takes a kernel-specific
    ms_per_sample * size; `huge` is ten times faster but needs 1 GiB of workspace, over the 64 MiB limit.
    Returns the step time per sample the WR optimum must give: the sum over the network's kernels."""
    per_sample = 0.0
    with Cache(path) as cache:
        seen = set()
        for i, (_, problem) in enumerate(kernels(NETWORK, 1, skip_first_bwd_data=True)):
            rate = ms_per_sample * (1 + i % 3)
            per_sample += rate
            if problem.key in seen:
                continue
            seen.add(problem.key)
            if len(seen) <= skip_keys:
                continue
            cache.store(
                device=model,
                backend="cudnn",
                versions="v1",
                problem_key=problem.key,
                micros=[
                    m
                    for b in MEASURED_SIZES
                    for m in (MicroConfig("gemm", b, rate * b, 1024), MicroConfig("huge", b, rate * b / 10, 2**30))
                ],
            )
    return per_sample


def test_measured_devices_use_their_cached_wr_times(tmp_path):
    ks = kernels(NETWORK, 1, skip_first_bwd_data=True)
    assert len({p.key for _, p in ks}) == len(ks)  # each kernel its own shape, so its own rate in fill_cache
    db = tmp_path / "c.db"
    fast = fill_cache(db, "Fast GPU", 0.01)
    slow = fill_cache(db, "Slow GPU", 0.02)
    plan = plan_cluster(30, ["Fast GPU", "Slow GPU"], network=NETWORK, db=str(db))
    assert [d.batch for d in plan.devices] == [20, 10]
    assert plan.devices[0].time_ms == pytest.approx(20 * fast)
    assert plan.devices[1].time_ms == pytest.approx(10 * slow)
    assert plan.devices[0].source == "measured: Fast GPU (cudnn)"
    assert plan.makespan_ms == pytest.approx(20 * fast)
    # b = 30 is not a measured size: WR divides it (16 + 8 + 4 + 2) and the times still add up.
    assert plan.best_single.device == "Fast GPU" and plan.best_single.time_ms == pytest.approx(30 * fast)
    assert [d.batch for d in plan.even] == [15, 15]
    assert plan.speedup_vs_even == pytest.approx(15 * slow / (20 * fast))
    # Without a workspace limit the "huge" algorithm is allowed and ten times faster everywhere.
    unlimited = plan_cluster(30, ["Fast GPU", "Slow GPU"], network=NETWORK, db=str(db), workspace_limit=None)
    assert unlimited.devices[0].time_ms == pytest.approx(20 * fast / 10)


def test_policy_limits_the_micro_batches_wr_may_use(tmp_path):
    db = tmp_path / "c.db"
    fill_cache(db, "Fast GPU", 0.01)
    # Only size 8 is allowed besides b itself: batch 12 cannot be divided, so the device cannot take it.
    plan = plan_cluster(16, ["Fast GPU"], network=NETWORK, db=str(db), policy="8", sizes=[8, 12, 16])
    assert [d.batch for d in plan.devices] == [16]
    with pytest.raises(Infeasible):
        plan_cluster(12, ["Fast GPU"], network=NETWORK, db=str(db), policy="8", sizes=[12])


def test_a_device_in_the_cache_without_every_kernel_is_refused(tmp_path):
    db = tmp_path / "c.db"
    fill_cache(db, "Partial GPU", 0.01, skip_keys=2)
    with pytest.raises(InvalidInput, match="not of every kernel"):
        plan_cluster(8, ["Partial GPU"], network=NETWORK, db=str(db))


def test_measured_and_profile_devices_mix_and_repeat(tmp_path):
    db = tmp_path / "c.db"
    fill_cache(db, "Fast GPU", 0.01)
    out = ucudnn.best_batch_size(64, ["Fast GPU", "k40", "k40"], network=NETWORK, db=str(db))
    assert len(out) == 3 and sum(out) == 64
    plan = plan_cluster(64, ["Fast GPU", "k40", "k40"], network=NETWORK, db=str(db))
    assert plan.devices[1].source == "estimated: k40 roofline"
    assert plan.devices[1].batch == pytest.approx(plan.devices[2].batch, abs=1)


def test_paper_cluster_gets_uneven_batches_and_an_even_split_is_slower():
    # The paper's §IV-C replay on shipped profiles: unequal devices get unequal batches...
    plan = plan_cluster(32, ["gk210", "gk210", "k20xm"], network="resnet18")
    batches = [d.batch for d in plan.devices]
    assert sum(batches) == 32 and batches[0] == batches[1] > batches[2]
    assert plan.speedup_vs_best_single > 2.0  # the paper measured 2.12x over one GK210
    # ...and an even split with the 750 Ti makes it the bottleneck (paper: 1.37x slower).
    with_750 = plan_cluster(32, ["k20xm", "gtx750ti"], network="resnet18")
    assert with_750.devices[1].batch < with_750.devices[0].batch
    assert with_750.speedup_vs_even >= 1.3
    assert with_750.even_makespan_ms == max(d.time_ms for d in with_750.even)


def test_profile_times_grow_with_the_batch_and_shrink_with_the_device():
    plan = plan_cluster(8, ["k40", "h100"], network="resnet18", sizes=range(1, 9))
    assert plan.devices[1].batch > plan.devices[0].batch
    assert plan.best_single.device == "h100"


def test_candidate_sizes_are_all_sizes_or_multiples_of_a_power_of_two():
    assert candidate_sizes(5) == [1, 2, 3, 4, 5]
    assert candidate_sizes(64) == list(range(1, 65))
    assert candidate_sizes(256) == list(range(4, 257, 4))
    assert candidate_sizes(100) == list(range(2, 101, 2))
    assert len(candidate_sizes(1000)) <= 65 and candidate_sizes(1000)[-1] == 1000


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mb": 0, "gpus": ["k40"]}, "mb"),
        ({"mb": 8, "gpus": []}, "gpus"),
        ({"mb": 8, "gpus": "k40"}, "gpus"),
        ({"mb": 8, "gpus": ["k40"], "network": "nonet"}, "unknown network"),
        ({"mb": 8, "gpus": ["nodevice"]}, "unknown device"),
        ({"mb": 8, "gpus": ["k40"], "sizes": [0, 3]}, "sizes must be"),
        ({"mb": 8, "gpus": ["k40"], "policy": "often"}, "unknown policy"),
    ],
)
def test_bad_arguments_are_named(kwargs, match, tmp_path, monkeypatch):
    monkeypatch.setenv("UCUDNN_DB", str(tmp_path / "none.db"))
    kwargs.setdefault("network", "resnet18")
    with pytest.raises(InvalidInput, match=match):
        ucudnn.best_batch_size(**kwargs)


# ---- the CLI ----------------------------------------------------------------------------------------


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_contract(tmp_path, capsys):
    db = tmp_path / "c.db"
    fast = fill_cache(db, "Fast GPU", 0.01)
    code, out, err = run(
        [
            "cluster",
            "--network",
            NETWORK,
            "--batch",
            "30",
            "--devices",
            "Fast GPU,k20xm,gtx750ti",
            "--db",
            str(db),
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["network"] == NETWORK and report["batch"] == 30
    assert [d["device"] for d in report["devices"]] == ["Fast GPU", "k20xm", "gtx750ti"]
    assert sum(d["batch"] for d in report["devices"]) == 30
    used = [d for d in report["devices"] if d["batch"]]
    assert report["makespan_ms"] == max(d["time_ms"] for d in used)
    assert report["devices"][0]["time_ms"] == pytest.approx(report["devices"][0]["batch"] * fast)
    single = report["best_single"]
    assert report["speedup_vs_best_single"] == pytest.approx(single["time_ms"] / report["makespan_ms"])
    assert report["speedup_vs_even"] == pytest.approx(report["even"]["makespan_ms"] / report["makespan_ms"])
    assert [d["batch"] for d in report["even"]["devices"]] == [10, 10, 10]
    assert report["speedup_vs_even"] >= 1.0 and report["speedup_vs_best_single"] >= 1.0


def test_cli_table_and_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("UCUDNN_DB", str(tmp_path / "none.db"))
    png = tmp_path / "bars.png"
    code, out, err = run(
        ["cluster", "--network", "resnet18", "--batch", "32", "--devices", "gk210,gk210,k20xm", "--plot", str(png)],
        capsys,
    )
    assert code == 0, err
    assert "makespan" in out and "vs even split" in out and out.count("estimated: gk210 roofline") == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--network", "resnet18", "--batch", "0", "--devices", "k40"], "batch"),
        (["--network", "resnet18", "--batch", "8", "--devices", "k40,,k40"], "empty entries"),
        (["--network", "resnet18", "--batch", "8", "--devices", "warpdrive"], "unknown device"),
        (["--network", "nonet", "--batch", "8", "--devices", "k40"], "unknown network"),
        (["--network", "resnet18", "--batch", "8", "--devices", "k40", "--workspace", "lots"], "cannot read size"),
        (["--network", "resnet18", "--batch", "8"], "--devices"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(argv, words, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("UCUDNN_DB", str(tmp_path / "none.db"))
    code, out, err = run(["cluster", *argv], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and words in err


def test_cli_no_split_exits_1(tmp_path, capsys):
    db = tmp_path / "c.db"
    fill_cache(db, "Fast GPU", 0.01)
    code, out, err = run(
        ["cluster", "--network", NETWORK, "--batch", "12", "--devices", "Fast GPU", "--db", str(db), "--policy", "8"],
        capsys,
    )
    assert code == 1 and len(err.strip().splitlines()) == 1 and "failed" in err
    assert out == ""
