"""The ``weighted`` policy: scorers and filters from YAML options, table-driven."""

from __future__ import annotations

import random

import pytest

from router.core.scheduler import default_registry
from router.core.types import ReplicaState, RoutingRequest


def reps(*specs):
    return [ReplicaState(id=f"r{i}", models=("m",), in_flight=ld, kv_usage=kv, waiting=w)
            for i, (ld, kv, w) in enumerate(specs)]


def pick(options, replicas, matches=None, req=None):
    p = default_registry().create("weighted", options)
    return p.choose(req or RoutingRequest(model="m"), replicas, matches or {}, random.Random(0))


@pytest.mark.parametrize("options, specs, want", [
    ({"scorers": {"load": 1}}, [(3, 0, 0), (1, 0, 0), (2, 0, 0)], "r1"),
    ({"scorers": {"kv_usage": 1}}, [(0, 0.9, 0), (0, 0.2, 0), (0, 0.5, 0)], "r1"),
    ({"scorers": {"queue": 1}}, [(0, 0, 4), (0, 0, 9), (0, 0, 0)], "r2"),
    # load dominates kv when weighted more
    ({"scorers": {"load": 2, "kv_usage": 1}}, [(0, 0.9, 0), (4, 0.0, 0)], "r0"),
    ({"scorers": {"load": 1, "kv_usage": 2}}, [(1, 0.9, 0), (2, 0.0, 0)], "r1"),
    # a filter drops the full replica even though it is the least loaded
    ({"scorers": {"load": 1}, "filters": {"max_kv_usage": 0.8}}, [(0, 0.95, 0), (5, 0.1, 0)], "r1"),
    # ... but never empties the field
    ({"scorers": {"load": 1}, "filters": {"max_kv_usage": 0.5}}, [(0, 0.95, 0), (5, 0.9, 0)], "r0"),
    ({"scorers": {"load": 1}, "filters": {"max_load": 3}}, [(3, 0, 0), (9, 0, 0), (2, 0, 0)], "r2"),
])
def test_table(options, specs, want):
    d = pick(options, reps(*specs))
    assert d.replica == want and d.policy == "weighted"
    assert set(d.scores) <= {r.id for r in reps(*specs)}


def test_prefix_scorer_needs_prefix_and_follows_matches():
    p = default_registry().create("weighted", {"scorers": {"prefix": 1, "load": 0.1}})
    assert p.needs_prefix
    req = RoutingRequest(model="m", hashes=[1, 2, 3, 4])
    d = p.choose(req, reps((1, 0, 0), (0, 0, 0)), {"r0": 4}, random.Random(0))
    assert d.replica == "r0" and d.matched_blocks == 4
    assert not default_registry().create("weighted", {}).needs_prefix


@pytest.mark.parametrize("options, key", [
    ({"scorers": {"nope": 1}}, "scorers.nope"),
    ({"scorers": {"load": -1}}, "scorers.load"),
    ({"scorers": {"load": 0}}, "scorers"),
    ({"scorers": []}, "scorers"),
    ({"filters": {"max_kv_usage": "x"}}, "filters.max_kv_usage"),
    ({"filters": {"other": 1}}, "filters.other"),
])
def test_bad_options_name_the_key(options, key):
    with pytest.raises(ValueError, match=f"policy.options.{key}"):
        default_registry().create("weighted", options)
