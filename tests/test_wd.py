"""wd.solve against brute force, and its two exact solvers against each other."""

from __future__ import annotations

import copy
import itertools
import math
import random

import pytest
from ucudnn.solver import Configuration, Infeasible, MicroConfig, wd

from ucudnn.errors import InvalidInput

SAME_OPTIMUM_REL = 1e-9
EXACT_METHODS = ("milp", "mckp")


def _config(time_ms: float, workspace_B: int, name: str = "a") -> Configuration:
    return Configuration((MicroConfig(name, 1, time_ms, workspace_B),))


def _random_front(rng: random.Random, n: int, *, integer: bool, spread_B: int = 1000) -> list[Configuration]:
    """A Pareto front: ascending workspace, strictly descending time (ints make ties likely)."""
    workspaces = sorted(rng.sample(range(spread_B), n))
    if integer:
        times = sorted(rng.sample(range(1, 100), n), reverse=True)
    else:
        times = sorted((rng.uniform(0.1, 10.0) for _ in range(n)), reverse=True)
    return [_config(float(t), w, f"c{i}") for i, (t, w) in enumerate(zip(times, workspaces, strict=True))]


def _totals(chosen: dict) -> tuple[float, int]:
    return sum(c.time for c in chosen.values()), sum(c.workspace for c in chosen.values())


def _brute_force(fronts: dict, total: int) -> float:
    best = math.inf
    for combo in itertools.product(*fronts.values()):
        if sum(c.workspace for c in combo) <= total:
            best = min(best, sum(c.time for c in combo))
    return best


def _check_answer(fronts: dict, total: int, chosen: dict) -> None:
    assert list(chosen) == list(fronts)
    for key, config in chosen.items():
        assert any(config is c for c in fronts[key]), "the answer is one of the given objects"
    assert _totals(chosen)[1] <= total


@pytest.mark.parametrize("method", ("auto", *EXACT_METHODS))
def test_matches_brute_force(method: str) -> None:
    rng = random.Random(11)
    for trial in range(120):
        fronts = {
            f"k{i}": _random_front(rng, rng.randint(2, 5), integer=trial % 2 == 0) for i in range(rng.randint(3, 5))
        }
        smallest = sum(f[0].workspace for f in fronts.values())
        largest = sum(f[-1].workspace for f in fronts.values())
        total = rng.randint(smallest, largest + 10)
        chosen = wd.solve(fronts, total, method=method)
        _check_answer(fronts, total, chosen)
        assert _totals(chosen)[0] == pytest.approx(_brute_force(fronts, total), rel=SAME_OPTIMUM_REL)


def test_ignores_dominated_and_unusable_options() -> None:
    fronts = {
        "a": [_config(5.0, 0), _config(6.0, 10), _config(math.inf, 0), _config(1.0, 100), _config(1.0, 200)],
        "b": [_config(3.0, 50), _config(2.0, 0)],  # not sorted; the first is dominated
    }
    for method in ("auto", *EXACT_METHODS):
        chosen = wd.solve(fronts, 100, method=method)
        assert chosen["a"] is fronts["a"][3] and chosen["b"] is fronts["b"][1]
        chosen = wd.solve(fronts, 99, method=method)
        assert chosen["a"] is fronts["a"][0] and chosen["b"] is fronts["b"][1]


@pytest.mark.parametrize("seed", range(2))
def test_milp_and_mckp_agree_on_large_instances(seed: int) -> None:
    rng = random.Random(100 + seed)
    fronts = {i: _random_front(rng, rng.randint(4, 10), integer=False, spread_B=10**9) for i in range(150)}
    smallest = sum(f[0].workspace for f in fronts.values())
    largest = sum(f[-1].workspace for f in fronts.values())
    for fraction in (0.05, 0.3, 0.8):
        total = int(smallest + fraction * (largest - smallest))
        answers = {m: wd.solve(fronts, total, method=m) for m in ("auto", *EXACT_METHODS)}
        for chosen in answers.values():
            _check_answer(fronts, total, chosen)
        optimum = _totals(answers["mckp"])[0]
        for method, chosen in answers.items():
            assert _totals(chosen)[0] == pytest.approx(optimum, rel=SAME_OPTIMUM_REL), method


def test_milp_and_mckp_agree_with_many_ties() -> None:
    """Small integers: equal slopes, equal workspaces across kernels and equal optima abound."""
    rng = random.Random(21)
    for _ in range(10):
        fronts = {i: _random_front(rng, rng.randint(1, 5), integer=True, spread_B=12) for i in range(40)}
        smallest = sum(f[0].workspace for f in fronts.values())
        largest = sum(f[-1].workspace for f in fronts.values())
        total = rng.randint(smallest, largest)
        optimum = _totals(wd.solve(fronts, total, method="milp"))[0]
        chosen = wd.solve(fronts, total, method="mckp")
        _check_answer(fronts, total, chosen)
        assert _totals(chosen)[0] == optimum


def test_auto_falls_back_to_milp_past_the_state_limit(monkeypatch) -> None:
    rng = random.Random(4)
    fronts = {i: _random_front(rng, 6, integer=False, spread_B=10**6) for i in range(30)}
    total = sum(f[0].workspace for f in fronts.values()) + 10**6
    expected = _totals(wd.solve(fronts, total, method="mckp"))[0]
    calls = []
    real_milp = wd._solve_milp
    monkeypatch.setattr(wd, "_AUTO_MAX_STATES", 1)
    monkeypatch.setattr(wd, "_solve_milp", lambda instance: calls.append(1) or real_milp(instance))
    assert _totals(wd.solve(fronts, total))[0] == pytest.approx(expected, rel=SAME_OPTIMUM_REL)
    assert calls == [1]


def test_trivial_totals() -> None:
    rng = random.Random(5)
    fronts = {i: _random_front(rng, 4, integer=False) for i in range(6)}
    smallest = sum(f[0].workspace for f in fronts.values())
    largest = sum(f[-1].workspace for f in fronts.values())
    for method in ("auto", *EXACT_METHODS):
        # Exactly the smallest sum is feasible: every kernel at its smallest option.
        assert all(c is fronts[k][0] for k, c in wd.solve(fronts, smallest, method=method).items())
        # Room for everything: every kernel at its fastest; an infinite total means no limit.
        for total in (largest, math.inf):
            assert all(c is fronts[k][-1] for k, c in wd.solve(fronts, total, method=method).items())


def test_zero_total_with_zero_workspace_options() -> None:
    fronts = {"a": [_config(2.0, 0), _config(1.0, 8)], "b": [_config(3.0, 0)]}
    for method in ("auto", *EXACT_METHODS):
        chosen = wd.solve(fronts, 0, method=method)
        assert chosen == {"a": fronts["a"][0], "b": fronts["b"][0]}


def test_infeasible_says_needed_and_given() -> None:
    fronts = {"a": [_config(2.0, 40), _config(1.0, 80)], "b": [_config(3.0, 70)]}
    for method in ("auto", *EXACT_METHODS):
        with pytest.raises(Infeasible, match=r"110 B.*109 B"):
            wd.solve(fronts, 109, method=method)
        assert wd.solve(fronts, 110, method=method) == {"a": fronts["a"][0], "b": fronts["b"][0]}
    with pytest.raises(Infeasible, match="'a'"):
        wd.solve({"a": [_config(math.inf, 0)]}, 10)


@pytest.mark.parametrize(
    ("fronts", "total", "method", "match"),
    [
        ({}, 10, "auto", "fronts"),
        ({"a": []}, 10, "auto", r"fronts\['a'\]"),
        ({"a": "xyz"}, 10, "auto", r"fronts\['a'\]"),
        ({"a": [object()]}, 10, "auto", r"fronts\['a'\]\[0\]"),
        ({"a": [_config(float("nan"), 0)]}, 10, "auto", r"fronts\['a'\]\[0\]"),
        ({"a": [_config(1.0, 0)]}, -1, "auto", "total_workspace"),
        ({"a": [_config(1.0, 0)]}, float("nan"), "auto", "total_workspace"),
        ({"a": [_config(1.0, 0)]}, True, "auto", "total_workspace"),
        ({"a": [_config(1.0, 0)]}, "1GiB", "auto", "total_workspace"),
        ({"a": [_config(1.0, 0)]}, 10, "glpk", "method"),
    ],
)
def test_rejects_bad_arguments(fronts, total, method, match) -> None:
    with pytest.raises(InvalidInput, match=match):
        wd.solve(fronts, total, method=method)


def test_does_not_mutate_inputs() -> None:
    rng = random.Random(9)
    fronts = {i: _random_front(rng, 5, integer=False) for i in range(20)}
    fronts[3] = list(reversed(fronts[3]))
    before = copy.copy(fronts), {k: list(v) for k, v in fronts.items()}
    smallest = sum(min(c.workspace for c in f) for f in fronts.values())
    for method in ("auto", *EXACT_METHODS):
        wd.solve(fronts, smallest + 500, method=method)
    assert (copy.copy(fronts), {k: list(v) for k, v in fronts.items()}) == before
