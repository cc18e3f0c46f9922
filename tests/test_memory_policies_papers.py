"""The shared invariants (tests/test_memory_policies.py) on the policies from the papers: swap-multi,
dymem and checkpoint, with the simulator's own record of non-resident reads."""

import pytest
from test_memory_policies import GIB, check_invariants

from ucudnn.memory import make_plan
from ucudnn.memory.graph import from_network


@pytest.mark.parametrize("policy", ["swap-multi", "dymem", "checkpoint"])
@pytest.mark.parametrize(
    "network,batch,device,limit_gib,devices",
    [
        ("vgg16", 64, "k40", 4, 1),
        ("resnet50", 32, "h100", 2, 1),
        ("googlenet", 32, "k40", 1, 1),
        ("densenet40", 64, "gk210", 1.5, 2),
    ],
)
def test_policy_invariants(policy, network, batch, device, limit_gib, devices):
    graph = from_network(network, batch)
    plan = make_plan(graph, device, int(limit_gib * GIB), policy, devices=devices)
    assert plan.policy == policy and plan.devices == devices
    assert plan.fits
    check_invariants(graph, plan)
