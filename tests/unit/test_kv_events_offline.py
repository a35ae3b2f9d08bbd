"""Exact tracking in virtual time: the simulator's own KV events applied to the pure index
keep it equal to the engine's cache through evictions and resets; offline replay runs in
both tracking modes."""

from __future__ import annotations

import random
from dataclasses import replace

from backends.sim.kvcache import KVCache
from loadtest.offline import OfflineConfig, roofline_for, simulate
from loadtest.traces.generators import tenants
from router.core.kv_tracker import apply_engine_events
from router.core.prefix_index import PrefixIndex


def held(index: PrefixIndex, replica: str, hashes) -> set[int]:
    return {h for h in hashes if replica in index.lookup([h])}


def test_index_follows_engine_cache_through_evictions_and_reset():
    rng = random.Random(1)
    kv = KVCache(32, 4, record_events=True)
    index = PrefixIndex(default_capacity=10_000)
    seen: set[int] = set()
    for n in range(60):
        k = rng.randrange(1, 6)
        if not kv.can_allocate([], k):
            continue
        blocks = kv.allocate(k)
        hashes = [n * 100 + j for j in range(k)]
        kv.store(blocks, hashes, None, ())
        kv.release(blocks)
        seen.update(hashes)
        apply_engine_events(index, "r0", kv.drain_events(), float(n))
        assert held(index, "r0", seen) == set(kv.cached_hashes())
    assert index.size("r0") == len(kv.cached_hashes()) <= 32 < len(seen)  # evictions happened
    kv.reset()
    assert apply_engine_events(index, "r0", kv.drain_events(), 99.0) == 1
    assert index.size("r0") == 0


def test_offline_replay_both_tracking_modes():
    reqs = tenants(n_requests=200, n_tenants=12, rate=20.0, system_blocks=(8, 24), user_blocks=(1, 4),
                   output=(2, 8), seed=3)
    cfg = OfflineConfig(replicas=3, gpu="a100-80gb", scrape_interval_s=0.5)
    out = {}
    for tracking in ("approx", "exact"):
        roof = roofline_for(cfg)
        roof.kv_capacity_blocks = 128
        out[tracking] = simulate(reqs, "cache_aware", replace(cfg, tracking=tracking), roof)
    for res in out.values():
        assert res.prompt_tokens > 0 and 0 < res.hit_rate < 1 and res.skipped == 0


def test_exact_tracking_needs_engine_sized_index_blocks():
    import pytest

    reqs = tenants(n_requests=5, n_tenants=2, seed=1)
    cfg = OfflineConfig(replicas=2, gpu="a100-80gb", tracking="exact", index_block_size=64)
    with pytest.raises(ValueError, match="index block size"):
        simulate(reqs, "cache_aware", cfg)
