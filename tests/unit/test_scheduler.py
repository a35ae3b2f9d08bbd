"""The scheduler framework and the simple policies, table-driven."""

import random

import pytest

from router.core.scheduler import default_registry
from router.core.types import NoReplicaError, ReplicaState, RoutingRequest


def reps(*loads, healthy=None):
    healthy = healthy or [True] * len(loads)
    return [ReplicaState(id=f"r{i}", models=("m",), in_flight=ld, healthy=h)
            for i, (ld, h) in enumerate(zip(loads, healthy, strict=True))]


def test_round_robin_cycles_over_healthy():
    p = default_registry().create("round_robin")
    rs = reps(0, 0, 0, healthy=[True, False, True])
    got = [p.choose(RoutingRequest(model="m"), rs, {}, random.Random(0)).replica for _ in range(4)]
    assert got == ["r0", "r2", "r0", "r2"]


def test_least_loaded_picks_min():
    p = default_registry().create("least_loaded")
    d = p.choose(RoutingRequest(model="m"), reps(3, 1, 2), {}, random.Random(0))
    assert d.replica == "r1" and d.reason == "least_loaded"


def test_power_of_two_never_picks_the_max_of_three_pairs():
    p = default_registry().create("power_of_two")
    rng = random.Random(1)
    picks = {p.choose(RoutingRequest(model="m"), reps(5, 0, 1), {}, rng).replica for _ in range(200)}
    assert "r0" not in picks


def test_no_replica_for_model():
    p = default_registry().create("random")
    with pytest.raises(NoReplicaError):
        p.choose(RoutingRequest(model="other"), reps(0), {}, random.Random(0))


def test_exclude_on_retry():
    p = default_registry().create("least_loaded")
    d = p.choose(RoutingRequest(model="m", exclude=frozenset({"r1"})), reps(3, 1, 2), {}, random.Random(0))
    assert d.replica == "r2"


def test_unknown_policy_error_names_known():
    with pytest.raises(ValueError, match="round_robin"):
        default_registry().create("nope")
