"""The pure tracker: engine events → router-hash index operations; sequence verdicts."""

from __future__ import annotations

from backends.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    UnknownEvent,
    sglang_block_hashes,
    vllm_block_hashes,
)
from router.core.hashing import block_hashes, seed_hash
from router.core.kv_tracker import IndexOp, ReplicaTracker, SeqTracker

TOKENS = [(i * 31) % 256 for i in range(64)]


def stored(eh, parent, toks, bs=16, **kw):
    return BlockStored(tuple(eh), parent, tuple(toks), bs, None, kw.pop("medium", "GPU"), **kw)


def test_stored_chain_is_rehashed_with_the_router_chain():
    t = ReplicaTracker("r0", "m", 16)
    eng = vllm_block_hashes(TOKENS, 16)
    ops = t.apply(EventBatch(0.0, (stored(eng[:2], None, TOKENS[:32]),)))
    ops += t.apply(EventBatch(0.0, (stored(eng[2:], eng[1], TOKENS[32:]),)))
    want = block_hashes(TOKENS, 16, seed_hash("m"))
    assert ops == [IndexOp("record", want[:2], "m"), IndexOp("record", want[2:], "m")]
    assert t.router_hashes(eng[3]) == (want[3],)
    # removal finds the router hashes; an unknown engine hash is counted, not fatal
    ops = t.apply(EventBatch(0.0, (BlockRemoved((eng[3], eng[2], 123), "GPU"),)))
    assert ops == [IndexOp("remove", [want[3], want[2]])]
    assert t.stats.unknown_removed == 1 and len(t) == 2


def test_sglang_hashes_work_the_same():
    t = ReplicaTracker("r0", "m", 16)
    eng = sglang_block_hashes(TOKENS, 16)
    ops = t.apply(EventBatch(0.0, (stored(eng, None, TOKENS),)))
    assert ops == [IndexOp("record", block_hashes(TOKENS, 16, seed_hash("m")), "m")]


def test_unknown_parent_is_skipped_and_counted():
    t = ReplicaTracker("r0", "m", 16)
    assert t.apply(EventBatch(0.0, (stored([5], 999, TOKENS[:16]),))) == []
    assert t.stats.unknown_parent == 1


def test_clear_resets_and_drops_earlier_ops_in_the_batch():
    t = ReplicaTracker("r0", "m", 16)
    ev = stored([1, 2], None, TOKENS[:32])
    ops = t.apply(EventBatch(0.0, (ev, AllBlocksCleared(), stored([3], None, TOKENS[:16]))))
    assert ops == [IndexOp("clear"), IndexOp("record", block_hashes(TOKENS[:16], 16, seed_hash("m")), "m")]
    assert t.router_hashes(1) is None and t.router_hashes(3) is not None


def test_salt_and_lora_seed_the_chain():
    t = ReplicaTracker("r0", "m", 16)
    ev = BlockStored((1,), None, tuple(TOKENS[:16]), 16, 3, "GPU", "lora-a", (("lora-a", "salt-1"),))
    (op,) = t.apply(EventBatch(0.0, (ev,)))
    # the router seeds a LoRA request with the adapter's name as its model
    assert op.hashes == block_hashes(TOKENS[:16], 16, seed_hash("lora-a", None, "salt-1"))
    assert op.model == "lora-a"
    (op,) = t.apply(EventBatch(0.0, (stored([2], None, TOKENS[:16]),)))
    assert op.model == "m"


def test_engine_block_multiple_of_router_block():
    t = ReplicaTracker("r0", "m", 16)
    (op,) = t.apply(EventBatch(0.0, (stored([10, 11], None, TOKENS, bs=32),)))
    want = block_hashes(TOKENS, 16, seed_hash("m"))
    assert op.hashes == want and t.router_hashes(11) == tuple(want[2:])
    assert t.apply(EventBatch(0.0, (BlockRemoved((11,)),))) == [IndexOp("remove", want[2:])]
    # a size that is not a multiple cannot be mapped
    assert t.apply(EventBatch(0.0, (stored([12], None, TOKENS[:24], bs=24),))) == []
    assert t.stats.skipped == 1


def test_other_medium_group_and_unknown_events_ignored():
    t = ReplicaTracker("r0", "m", 16)
    batch = EventBatch(0.0, (stored([1], None, TOKENS[:16], medium="CPU"),
                             BlockStored((2,), None, tuple(TOKENS[:16]), 16, group_idx=1),
                             UnknownEvent("X"), AllBlocksCleared(medium="CPU")))
    assert t.apply(batch) == []
    assert t.stats.skipped == 2 and t.stats.unknown_events == 1 and t.stats.clears == 0


def test_short_token_list_skipped():
    t = ReplicaTracker("r0", "m", 16)
    assert t.apply(EventBatch(0.0, (stored([1, 2], None, TOKENS[:20]),))) == []
    assert t.stats.skipped == 1


def test_map_is_bounded():
    t = ReplicaTracker("r0", "m", 1, max_map=10)
    t.apply(EventBatch(0.0, (stored(list(range(100, 130)), None, list(range(30)), bs=1),)))
    assert len(t) == 10 and t.stats.map_evictions == 20
    assert t.router_hashes(129) is not None and t.router_hashes(100) is None


def test_seq_tracker():
    s = SeqTracker()
    assert s.check(5) == "first"
    s.accept(5)
    assert s.check(6) == "next" and s.check(9) == "gap" and s.check(5) == "old" and s.check(0) == "old"


def test_holds_follows_store_remove_clear():
    t = ReplicaTracker("r0", "m", 16)
    want = block_hashes(TOKENS, 16, seed_hash("m"))
    t.apply(EventBatch(0.0, (stored([1, 2, 3, 4], None, TOKENS),)))
    assert all(t.holds(h) for h in want)
    t.apply(EventBatch(0.0, (BlockRemoved((4,)),)))
    assert not t.holds(want[3]) and t.holds(want[2])
    # two engine blocks naming the same router block: held until both are gone
    t.apply(EventBatch(0.0, (stored([9], None, TOKENS[:16]),)))
    t.apply(EventBatch(0.0, (BlockRemoved((1,)),)))
    assert t.holds(want[0])
    t.apply(EventBatch(0.0, (AllBlocksCleared(),)))
    assert not any(t.holds(h) for h in want)
