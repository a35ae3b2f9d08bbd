"""Hit-rate accounting: hand-computed small cases for the ideal figures, and invariants."""

from __future__ import annotations

import pytest

from loadtest.hitrate import LRUBlocks, chain_keys, ideal_infinite, ideal_pooled_lru, request_stats
from loadtest.traces.generators import mixed
from loadtest.traces.types import TraceRequest


def _req(ids: list[int], n: int) -> TraceRequest:
    return TraceRequest(0.0, n, 1, ids, block_size=4)


# A, B, C, D, E with 4-token blocks (B's last block holds 2 tokens).
CASE = [_req([1, 2], 8), _req([1, 2, 3], 10), _req([1, 5], 6), _req([9], 4), _req([1, 2], 8)]


def test_ideal_infinite_hand_computed():
    s = ideal_infinite(CASE)
    # hits: A 0, B 2 blocks (8 tokens), C 1 (4), D 0, E 2 (8)
    assert (s.hit_tokens, s.total_tokens, s.hit_blocks, s.total_blocks) == (20, 36, 5, 10)
    assert s.token_rate == pytest.approx(20 / 36)
    assert s.block_rate == pytest.approx(0.5)


def test_ideal_pooled_lru_hand_computed():
    # capacity 2: after C the cache holds {5, 1}; D evicts 5 → {1, 9}; E hits only block 1.
    s = ideal_pooled_lru(CASE, 2)
    assert (s.hit_tokens, s.hit_blocks) == (16, 4)
    assert s.total_tokens == 36
    # large enough: same as infinite; zero: nothing
    assert ideal_pooled_lru(CASE, 100) == ideal_infinite(CASE)
    assert ideal_pooled_lru(CASE, 0).hit_tokens == 0


def test_partial_last_block_weighs_its_tokens():
    reqs = [_req([1, 2, 3], 10), _req([1, 2, 3], 10)]
    s = ideal_infinite(reqs)
    assert s.hit_tokens == 10 and s.total_tokens == 20  # the 2-token tail counts 2, not 4
    assert request_stats(reqs[0], 3).hit_tokens == 10


def test_prefix_chain_not_ids_decides_hits():
    # the same id after a different prefix is a different block
    reqs = [_req([1, 2], 8), _req([7, 2], 8)]
    assert ideal_infinite(reqs).hit_blocks == 0
    assert chain_keys([1, 2])[0] == chain_keys([1, 3])[0]
    assert chain_keys([1, 2])[1] != chain_keys([7, 2])[1]


def test_lru_keeps_head_of_prompt_longer_than_cache():
    lru = LRUBlocks(2)
    assert lru.access([1, 2, 3]) == 0
    assert 1 in lru and 2 in lru and 3 not in lru
    assert lru.access([1, 2, 3]) == 2
    with pytest.raises(ValueError):
        LRUBlocks(-1)


def test_pooled_is_monotone_in_capacity_and_bounded_by_infinite():
    reqs = mixed(seed=3)
    inf = ideal_infinite(reqs).token_rate
    rates = [ideal_pooled_lru(reqs, c).token_rate for c in (0, 100, 1000, 10_000, 10**7)]
    assert rates[0] == 0.0
    assert all(a <= b + 1e-12 for a, b in zip(rates, rates[1:], strict=False))
    assert rates[-1] == pytest.approx(inf)
    assert 0 < inf < 1
