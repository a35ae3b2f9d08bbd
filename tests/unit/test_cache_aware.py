"""The cache_aware and session policies: table-driven decisions on replica snapshots."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.core.scheduler import default_registry
from router.core.types import NoReplicaError, ReplicaState, RoutingRequest


def reps(*loads: float, kv: float = 0.0) -> list[ReplicaState]:
    return [ReplicaState(id=f"r{i}", in_flight=int(x), kv_usage=kv) for i, x in enumerate(loads)]


def req(n_blocks: int = 10, first: int = 1, key: str | None = None) -> RoutingRequest:
    return RoutingRequest(model="m", hashes=list(range(first, first + n_blocks)),
                          num_tokens=n_blocks * 16, block_size=16, session_key=key)


@pytest.fixture
def policy():
    return default_registry().create("cache_aware", {})


def test_longest_match_wins_at_equal_load(policy) -> None:
    d = policy.choose(req(), reps(0, 0, 0), {"r1": 8, "r2": 3}, random.Random(0))
    assert (d.replica, d.reason, d.matched_blocks, d.matched_tokens) == ("r1", "prefix_hit", 8, 128)
    assert d.scores["r1"] > d.scores["r2"] > d.scores["r0"]


def test_load_guard_moves_a_hot_prefix_off_an_overloaded_replica(policy) -> None:
    # loads 6,1,1,0 -> bound = ceil(1.25 * 9 / 4) + 1 = 4; r0 holds the whole prefix but is above it
    d = policy.choose(req(), reps(6, 1, 1, 0), {"r0": 10, "r2": 4}, random.Random(0))
    assert d.replica == "r2" and d.reason == "load_guard"


def test_cold_request_goes_to_least_loaded(policy) -> None:
    d = policy.choose(req(), reps(3, 1, 2), {}, random.Random(0))
    assert (d.replica, d.reason) == ("r1", "cold")
    d = policy.choose(RoutingRequest(model="m"), reps(3, 1, 2), {}, random.Random(0))
    assert (d.replica, d.reason) == ("r1", "no_prefix")


def test_cold_ties_spread_deterministically_by_prompt(policy) -> None:
    picks = Counter(policy.choose(req(first=i * 100), reps(0, 0, 0, 0), {}, random.Random(0)).replica
                    for i in range(400))
    assert len(picks) == 4 and min(picks.values()) > 50
    a = policy.choose(req(first=7), reps(0, 0, 0, 0), {}, random.Random(1)).replica
    b = policy.choose(req(first=7), reps(0, 0, 0, 0), {}, random.Random(2)).replica
    assert a == b  # two routers send the same new prompt to the same replica


def test_weights_from_options_trade_hits_for_load() -> None:
    state, matches = reps(2, 0), {"r0": 3}  # 30 % match on a busier replica
    hit = default_registry().create("cache_aware", {"load_weight": 0.0, "balance_factor": 4})
    assert hit.choose(req(), state, matches, random.Random(0)).replica == "r0"
    load = default_registry().create("cache_aware", {"load_weight": 2.0, "balance_factor": 4})
    d = load.choose(req(), state, matches, random.Random(0))
    assert (d.replica, d.reason) == ("r1", "load")
    with pytest.raises(ValueError, match="balance_factor"):
        default_registry().create("cache_aware", {"balance_factor": 0.5})
    with pytest.raises(ValueError, match="hit_weight"):
        default_registry().create("cache_aware", {"hit_weight": "x"})


def test_hot_shared_prefix_spreads_within_the_bound(policy) -> None:
    """Every request shares the prefix held by r0; in-flight stays within c × mean + 2
    (the bound's ceiling and its one-request slack)."""
    state = reps(0, 0, 0, 0)
    rng = random.Random(3)
    for _ in range(200):
        d = policy.choose(req(), state, {"r0": 10, "r1": 2}, rng)
        next(r for r in state if r.id == d.replica).in_flight += 1
        loads = [r.in_flight for r in state]
        assert max(loads) <= 1.25 * sum(loads) / 4 + 2
    assert min(r.in_flight for r in state) > 0
    strict = default_registry().create("cache_aware", {"load_slack": 0})
    state = reps(1, 0, 0, 0)  # strict bound ceil(1.25 * 2 / 4) = 1: r0 is full
    assert strict.choose(req(), state, {"r0": 10}, rng).reason == "load_guard"
    assert policy.choose(req(), state, {"r0": 10}, rng).reason == "prefix_hit"


def test_excluded_and_unhealthy_replicas_are_skipped(policy) -> None:
    state = reps(0, 0, 0)
    state[1].healthy = False
    r = req()
    r.exclude = frozenset({"r0"})
    assert policy.choose(r, state, {"r0": 10, "r1": 10}, random.Random(0)).replica == "r2"
    r.exclude = frozenset({"r0", "r2"})
    with pytest.raises(NoReplicaError):
        policy.choose(r, state, {}, random.Random(0))


def test_session_is_sticky_and_moves_only_when_overloaded() -> None:
    pol = default_registry().create("session", {"vnodes": 32})
    state = reps(0, 0, 0, 0)
    homes = {k: pol.choose(req(key=k), state, {}, random.Random(0)).replica for k in map(str, range(200))}
    assert len(set(homes.values())) == 4
    assert all(pol.choose(req(key=k), state, {}, random.Random(9)).replica == h for k, h in homes.items())
    home = homes["5"]
    busy = [ReplicaState(id=r.id, in_flight=8 if r.id == home else 0) for r in state]
    d = pol.choose(req(key="5"), busy, {}, random.Random(0))
    assert d.replica != home and d.reason == "load_guard"
    # removing one replica moves only that replica's sessions
    gone = "r3"
    rest = [r for r in state if r.id != gone]
    moved = [k for k, h in homes.items() if pol.choose(req(key=k), rest, {}, random.Random(0)).replica != h]
    assert moved and all(homes[k] == gone for k in moved)
    d = pol.choose(req(key=None), reps(2, 0, 1), {}, random.Random(0))
    assert (d.replica, d.reason) == ("r1", "no_session")
