"""The simulated KV cache: sharing, LRU order (tail-first frees), eviction events, reset."""

import pytest

from backends.sim.kvcache import AllBlocksCleared, BlockRemoved, BlockStored, KVCache


def test_allocate_store_match_and_share():
    kv = KVCache(8, 4, record_events=True)
    blocks = kv.allocate(3)
    assert kv.num_free == 5 and kv.usage() == pytest.approx(3 / 8)
    assert kv.store(blocks, [11, 12, 13], None, list(range(12))) == 3
    assert kv.match([11, 12, 99], 10) == blocks[:2]
    assert kv.match([11, 12, 13], 2) == blocks[:2]  # capped
    assert kv.match([99, 11], 10) == []  # leading run only
    kv.share(blocks[:2])
    assert kv.ref[blocks[0]] == 2
    (ev,) = kv.drain_events()
    assert ev == BlockStored((11, 12, 13), None, tuple(range(12)), 4)
    assert kv.drain_events() == []


def test_free_blocks_stay_cached_until_reused_lru_tail_first():
    kv = KVCache(6, 4, record_events=True)
    a = kv.allocate(3)
    kv.store(a, [1, 2, 3], None)
    b = kv.allocate(3)
    kv.store(b, [4, 5, 6], None)
    kv.release(a)  # a's blocks: tail first into the free queue
    kv.release(b)
    assert kv.num_free == 6 and kv.usage() == 0.0
    assert kv.match([1, 2, 3], 3) == a  # still hits while free
    kv.drain_events()
    kv.allocate(1)  # evicts a's LAST block first (least recently used, tail first)
    assert kv.match([1, 2, 3], 3) == a[:2]
    assert kv.drain_events() == [BlockRemoved((3,))]
    kv.allocate(2)
    assert kv.match([1, 2, 3], 3) == []
    assert kv.match([4, 5, 6], 3) == b  # b was freed later: evicted after a
    assert kv.evictions == 3


def test_hit_on_free_block_revives_it_and_can_allocate_counts_it():
    kv = KVCache(4, 4)
    a = kv.allocate(2)
    kv.store(a, [1, 2], None)
    kv.release(a)
    other = kv.allocate(2)  # takes the two never-used blocks
    assert set(other).isdisjoint(a)
    assert kv.can_allocate(a, 0) and not kv.can_allocate(a, 1)
    kv.share(a)
    assert kv.num_free == 0
    with pytest.raises(MemoryError):
        kv.allocate(1)


def test_duplicate_hash_is_not_cached_twice_and_reset_clears():
    kv = KVCache(4, 4, record_events=True)
    a, b = kv.allocate(1), kv.allocate(1)
    assert kv.store(a, [7], None) == 1
    assert kv.store(b, [7], None) == 0
    assert kv.match([7], 1) == a
    kv.drain_events()
    kv.reset()
    assert kv.match([7], 1) == [] and kv.num_cached == 0
    assert kv.drain_events() == [AllBlocksCleared()]


def test_prefix_caching_disabled_never_caches():
    kv = KVCache(4, 4, enable_prefix_caching=False)
    a = kv.allocate(2)
    assert kv.store(a, [1, 2], None) == 0
    assert kv.match([1, 2], 2) == []


def test_repeated_hash_within_one_store_keeps_the_invariant():
    kv = KVCache(4, 4)
    a = kv.allocate(3)
    assert kv.store(a, [5, 6, 5], None) == 2
    kv.release(a)
    kv.allocate(4)  # evicts everything without error
    assert kv.num_cached == 0 and kv.evictions == 2
