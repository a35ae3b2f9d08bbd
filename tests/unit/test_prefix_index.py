"""The pure in-memory prefix index: matching, LRU capacity, TTL, remove, O(1) clear."""

from __future__ import annotations

import pytest

from router.core.hashing import block_hashes, seed_hash
from router.core.prefix_index import PrefixIndex


def chain(prefix: list[int], n_blocks: int, bs: int = 4, model: str = "m") -> list[int]:
    toks = (prefix * (n_blocks * bs // max(1, len(prefix)) + 1))[: n_blocks * bs]
    return block_hashes(toks, bs, seed_hash(model))


def test_longest_consecutive_prefix_per_replica() -> None:
    idx = PrefixIndex()
    a = chain([1, 2, 3], 10)
    idx.record(a[:6], "r0")
    idx.record(a[:3], "r1")
    assert idx.lookup(a) == {"r0": 6, "r1": 3}
    assert idx.lookup(a[:2]) == {"r0": 2, "r1": 2}
    assert idx.lookup(chain([9, 9], 5)) == {}
    assert idx.lookup([]) == {}
    assert idx.lookup(a, replicas=["r1"]) == {"r1": 3}


def test_a_gap_ends_the_match() -> None:
    idx = PrefixIndex()
    a = chain([5], 6)
    idx.record(a, "r0")
    idx.remove("r0", [a[2]])
    assert idx.lookup(a) == {"r0": 2}


def test_capacity_evicts_least_recently_used_tails_first() -> None:
    idx = PrefixIndex(default_capacity=8)
    a, b = chain([1], 6), chain([2], 6)
    idx.record(a, "r0")
    idx.record(b, "r0")  # 12 blocks > 8: a's 4 tail blocks go first
    assert idx.size("r0") == 8
    assert idx.lookup(a) == {"r0": 2}
    assert idx.lookup(b) == {"r0": 6}
    idx.record(a[:2], "r0")  # refresh a's head: b's tail is now oldest
    idx.record(chain([3], 2), "r0")
    assert idx.lookup(a) == {"r0": 2}
    assert idx.lookup(b) == {"r0": 4}
    assert idx.evictions == 6


def test_per_replica_capacity_and_shrink() -> None:
    idx = PrefixIndex(default_capacity=100, capacities={"small": 3})
    a = chain([7], 10)
    idx.record(a, "small")
    idx.record(a, "big")
    assert idx.lookup(a) == {"small": 3, "big": 10}
    idx.set_capacity("big", 5)
    assert idx.lookup(a) == {"small": 3, "big": 5}
    with pytest.raises(ValueError):
        idx.set_capacity("big", 0)


def test_ttl_expires_entries_not_rerecorded() -> None:
    idx = PrefixIndex(ttl_s=10)
    a = chain([4], 4)
    idx.record(a, "r0", now=0)
    idx.record(a[:2], "r1", now=0)
    assert idx.lookup(a, now=9) == {"r0": 4, "r1": 2}
    idx.record(a[:2], "r0", now=8)
    assert idx.lookup(a, now=15) == {"r0": 2}


def test_clear_is_immediate_and_memory_is_purged() -> None:
    idx = PrefixIndex()
    a, b = chain([1], 50), chain([2], 50)
    idx.record(a, "r0")
    idx.record(a, "r1")
    g = idx.generation("r0")
    idx.clear("r0")
    assert idx.generation("r0") == g + 1
    assert idx.lookup(a) == {"r1": 50}
    assert idx.size("r0") == 0
    idx.record(a[:10], "r0")  # re-recorded blocks survive the purge of the old generation
    idx.record(b, "r2")
    idx.purge()
    assert idx.lookup(a) == {"r1": 50, "r0": 10}
    assert len(idx._blocks) == 100  # a's 50 + b's 50: no stale entry left behind
    idx.clear("r1")
    idx.clear("r0")
    idx.clear("r2")
    idx.purge()
    assert len(idx._blocks) == 0 and len(idx) == 0


def test_memory_stays_bounded_under_churn() -> None:
    idx = PrefixIndex(default_capacity=200)
    for i in range(300):
        idx.record(chain([i, i + 1], 20), f"r{i % 3}")
        if i % 50 == 49:
            idx.clear(f"r{i % 3}")
    assert len(idx) <= 600
    assert len(idx._blocks) <= 600 + idx.purge_batch * 3
