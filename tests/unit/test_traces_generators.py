"""Synthetic generators (seeded, reproducible, the structure each one promises) and
prompts from hash ids (same id at same position → same tokens; block-exact text)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from loadtest.traces import generators as g
from loadtest.traces.prompts import PromptBuilder
from loadtest.traces.types import TraceRequest
from router.core import bytetok
from router.core.hashing import block_hashes


def _shape(reqs):
    return [(r.timestamp_s, r.input_length, r.output_length, tuple(r.hash_ids), r.session_id) for r in reqs]


@pytest.mark.parametrize("kind", sorted(g.GENERATORS))
def test_generators_are_seeded_and_prefix_chained(kind):
    a, b, c = g.generate(kind, seed=7), g.generate(kind, seed=7), g.generate(kind, seed=8)
    assert _shape(a) == _shape(b)
    assert _shape(a) != _shape(c)
    assert a and a[0].timestamp_s == 0.0
    assert all(x.timestamp_s <= y.timestamp_s for x, y in zip(a, a[1:], strict=False))
    # prefix-chained: an id at position i always comes after the same prefix
    prefix_of: dict[tuple[int, int], tuple[int, ...]] = {}
    for r in a:
        assert r.input_length == len(r.hash_ids) * r.block_size
        for i, h in enumerate(r.hash_ids):
            assert prefix_of.setdefault((i, h), tuple(r.hash_ids[:i])) == tuple(r.hash_ids[:i])


def test_tenants_share_system_prompt_with_zipf_popularity():
    reqs = g.tenants(n_requests=2000, n_tenants=10, zipf_s=1.2, system_blocks=(4, 4), seed=1)
    by = defaultdict(list)
    for r in reqs:
        by[r.tenant].append(r)
    for rs in by.values():
        assert len({tuple(r.hash_ids[:4]) for r in rs}) == 1
    assert len({tuple(rs[0].hash_ids[:4]) for rs in by.values()}) == len(by)
    counts = sorted((len(v) for v in by.values()), reverse=True)
    assert counts[0] > 3 * counts[-1]  # popularity is skewed


def test_multi_turn_and_agentic_contexts_grow():
    for reqs in (g.multi_turn(n_sessions=20, seed=2), g.agentic(n_agents=5, seed=2)):
        by = defaultdict(list)
        for r in reqs:
            by[r.session_id].append(r)
        assert any(len(v) > 1 for v in by.values())
        for turns in by.values():
            for prev, nxt in zip(turns, turns[1:], strict=False):
                assert nxt.timestamp_s > prev.timestamp_s
                assert nxt.hash_ids[: len(prev.hash_ids)] == prev.hash_ids
                assert len(nxt.hash_ids) > len(prev.hash_ids)


def test_rag_reuses_documents_after_a_shared_system_prompt():
    reqs = g.rag(n_requests=300, n_docs=20, docs_per_request=(1, 1), doc_blocks=(5, 5), system_blocks=3, seed=3)
    assert len({tuple(r.hash_ids[:3]) for r in reqs}) == 1
    assert len({tuple(r.hash_ids[:8]) for r in reqs}) <= 20  # system + one of 20 documents
    with pytest.raises(ValueError, match="unknown generator"):
        g.generate("nope")


def test_prompt_text_is_block_exact_with_byte_tokenizer():
    pb = PromptBuilder(block_size=16, seed=5)
    a = TraceRequest(0, 40, 1, [1, 2, 3], block_size=16)   # last block: 8 tokens
    b = TraceRequest(1, 48, 1, [1, 2, 9], block_size=16)
    ta, tb = pb.text(a), pb.text(b)
    assert len(ta) == 40 and ta.isascii() and len(tb) == 48
    assert ta[:32] == tb[:32] and ta[32:40] != tb[32:40]
    toks = bytetok.encode(ta)
    assert toks[16:32] == bytetok.encode(pb.block_text(2, 1))
    ha, hb = block_hashes(bytetok.encode(ta), 16, 0), block_hashes(bytetok.encode(tb), 16, 0)
    assert ha[:2] == hb[:2] and len(ha) == 2 and len(hb) == 3
    # partial block is a prefix of the full block; another position gives other content
    assert pb.block_text(3, 2).startswith(ta[32:40])
    assert pb.block_text(1, 0) != pb.block_text(1, 1)
    # reproducible across builders, different across seeds
    assert PromptBuilder(16, seed=5).text(a) == ta and PromptBuilder(16, seed=6).text(a) != ta


def test_prompt_token_ids_and_tails():
    pb = PromptBuilder(block_size=8, vocab_lo=100, vocab_hi=200)
    r = TraceRequest(0, 20, 1, [4, 5], block_size=8)  # ids cover 16 tokens; 4 filled per request
    ids = pb.token_ids(r)
    assert len(ids) == 20 and all(100 <= t < 200 for t in ids)
    assert ids[:8] == pb.block_token_ids(4, 0) and ids[:16] == PromptBuilder(8, 0, 100, 200).token_ids(r)[:16]
    assert len(pb.text(r)) == 20
    with pytest.raises(ValueError, match="block size"):
        pb.text(TraceRequest(0, 20, 1, [4], block_size=16))
