"""Dymem's execution order, mobility classes and prefetch look-ahead on hand-drawn graphs."""

import pytest

from ucudnn.errors import InvalidInput
from ucudnn.memory.dymem_order import dfs_order, prefetch_starts

# After the paper's Figure 10 (Inception-A): l0 forks into four branches of 1, 1, 2 and 3
# operations that join at l9, then a fully connected layer.
INCEPTION = {
    "l0": ["l1", "l2", "l3", "l4"],
    "l1": ["l9"],
    "l2": ["l9"],
    "l3": ["l5"],
    "l5": ["l9"],
    "l4": ["l6"],
    "l6": ["l7"],
    "l7": ["l9"],
    "l9": ["fc"],
    "fc": [],
}


def test_dfs_explores_each_branch_to_the_join():
    assert dfs_order(INCEPTION) == ["l0", "l1", "l2", "l3", "l5", "l4", "l6", "l7", "l9", "fc"]


def test_dfs_order_is_topological_on_a_residual_chain():
    # 300 residual blocks: deeper than the recursion limit would allow
    succ = {}
    for b in range(300):
        succ[f"in{b}"] = [f"conv{b}", f"add{b}"]
        succ[f"conv{b}"] = [f"add{b}"]
        succ[f"add{b}"] = [f"in{b + 1}"]
    succ["in300"] = []
    order = dfs_order(succ)
    position = {op: k for k, op in enumerate(order)}
    assert all(position[a] < position[b] for a, nexts in succ.items() for b in nexts)
    assert order[:4] == ["in0", "conv0", "add0", "in1"]


def test_dfs_rejects_cycles_and_unknown_names():
    with pytest.raises(InvalidInput, match="cycle"):
        dfs_order({"a": ["b"], "b": ["a"]})
    with pytest.raises(InvalidInput, match="not an operation"):
        dfs_order({"a": ["zz"]})


def test_prefetch_looks_ahead_two_convolutions():
    steps = [
        ("relu", ["a"]),
        ("conv", ["b"]),
        ("pool", ["c"]),
        ("conv", ["d"]),
        ("relu", ["e"]),
        ("conv", ["f"]),
        ("conv", ["g"]),
    ]
    starts = prefetch_starts(steps, {"a", "b", "c", "d", "e", "f", "g"})
    # before the pass (-1) the window reaches the second conv (step 3): a, b, c, d
    assert starts == {"a": -1, "b": -1, "c": -1, "d": -1, "e": 1, "f": 1, "g": 3}
    # one conv of look-ahead: the window from -1 ends at step 1
    starts = prefetch_starts(steps, {"c", "g"}, conv_lookahead=1)
    assert starts == {"c": 1, "g": 5}
    # tensors not offloaded are not prefetched
    assert prefetch_starts(steps, set()) == {}
