"""The pure engine model: prefix hits, eviction, batching limits, chunked prefill, preemption,
cancellation, determinism, speculative decoding and fast-forward, in virtual time."""

from __future__ import annotations

import random

import pytest

from backends.planner import PlanInput, Roofline, get_gpu, get_model
from backends.sim.engine import EngineConfig, EngineModel, Request, StepResult
from backends.sim.kvcache import BlockRemoved, BlockStored
from router.core.hashing import block_hashes, seed_hash


class LinearCost:
    """A transparent cost model for unit tests: 1 ms per step + 0.1 ms per prefill token."""

    def step_time_s(self, prefill_tokens: int, decode_seqs: int, kv_tokens_read: int) -> float:
        return 0.001 + 1e-4 * prefill_tokens + 1e-8 * kv_tokens_read

    def spec_step_time_s(self, decode_seqs: int, kv_tokens: int) -> float:
        return 1.5 * self.step_time_s(0, decode_seqs, kv_tokens)


def engine(num_blocks: int = 1000, cost=None, **kw) -> EngineModel:
    kw.setdefault("max_model_len", num_blocks * kw.get("block_size", 16) - 32)
    return EngineModel(EngineConfig(num_blocks=num_blocks, **kw), cost or LinearCost())


def run(eng: EngineModel, now: float = 0.0, fast: bool = False) -> tuple[float, list[StepResult]]:
    results = []
    while eng.has_work():
        res = eng.fast_forward(now) if fast else eng.step(now)
        assert res.steps >= 1
        results.append(res)
        now = res.end
    return now, results


def ids(n: int, salt: int = 0) -> list[int]:
    rng = random.Random(salt)
    return [rng.randrange(256) for _ in range(n)]


def test_repeat_prompt_hits_all_full_blocks_but_the_last_and_is_faster():
    rl = Roofline(PlanInput(model=get_model("llama-3.1-8b"), gpu=get_gpu("a100-80gb")))
    eng = engine(rl.kv_capacity_blocks, rl)
    p = ids(2000)
    a = Request("a", 2000, 4, prompt_ids=list(p))
    eng.submit(a, 0.0)
    t, _ = run(eng)
    b = Request("b", 2000, 4, prompt_ids=list(p))
    eng.submit(b, t)
    run(eng, t)
    assert a.cached_tokens == 0
    assert b.cached_tokens == 1984  # 124 of 125 blocks: the last token is always computed
    ttft_a, ttft_b = a.first_token_time - a.arrival, b.first_token_time - b.arrival
    assert ttft_a > 5 * ttft_b
    assert eng.stats.prefix_cache_hits == 1984 and eng.stats.prefix_cache_queries == 4000


def test_engine_hashes_equal_router_hashes_and_partial_blocks_never_hit():
    eng = engine(record_kv_events=True, model="m")
    p = ids(40)
    eng.submit(Request("a", 40, 1, prompt_ids=list(p)), 0.0)
    t, _ = run(eng)
    stored = [e for e in eng.drain_kv_events() if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == block_hashes(p, 16, seed_hash("m"))
    assert stored[0].parent_block_hash is None and stored[0].token_ids == tuple(p[:32])
    b = Request("b", 40, 1, prompt_ids=p[:20] + ids(20, 1))  # shares 20 tokens: one full block
    eng.submit(b, t)
    run(eng, t)
    assert b.cached_tokens == 16


def test_precomputed_hashes_without_token_ids():
    eng = engine(block_size=16)
    hs = [101, 102, 103, 104]
    eng.submit(Request("a", 64, 3, block_hashes=list(hs)), 0.0)
    t, _ = run(eng)
    b = Request("b", 70, 3, block_hashes=[101, 102, 999, 998])
    eng.submit(b, t)
    run(eng, t)
    assert b.cached_tokens == 32 and b.num_output == 3 and b.output_ids is None


def test_lru_eviction_then_the_evicted_prefix_misses():
    eng = engine(num_blocks=20, block_size=16)
    first = ids(160, 1)  # 10 blocks
    eng.submit(Request("a", 160, 1, prompt_ids=list(first)), 0.0)
    t, _ = run(eng)
    for i in range(3):  # 3 × 10 new blocks through a 20-block cache
        eng.submit(Request(f"f{i}", 160, 1, prompt_ids=ids(160, 10 + i)), t)
        t, _ = run(eng, t)
    again = Request("again", 160, 1, prompt_ids=list(first))
    eng.submit(again, t)
    run(eng, t)
    assert again.cached_tokens == 0
    assert eng.kv.evictions >= 10


def test_no_prefix_caching():
    eng = engine(enable_prefix_caching=False)
    p = ids(100)
    for name in "ab":
        r = Request(name, 100, 2, prompt_ids=list(p))
        eng.submit(r, 0.0)
        run(eng)
        assert r.cached_tokens == 0


def test_chunked_prefill_respects_the_token_budget():
    eng = engine(max_num_batched_tokens=512)
    r = Request("a", 2000, 2, block_hashes=[])
    eng.submit(r, 0.0)
    _, results = run(eng)
    assert all(res.prefill_tokens <= 512 for res in results)
    assert sum(res.prefill_tokens for res in results) == 2000
    assert sum(1 for res in results if res.prefill_tokens) == 4
    assert r.first_token_time == pytest.approx(results[3].end)


def test_max_num_seqs_limits_the_batch():
    eng = engine(max_num_seqs=2)
    for i in range(5):
        eng.submit(Request(str(i), 10, 5, block_hashes=[]), 0.0)
    now, peak = 0.0, 0
    while eng.has_work():
        now = eng.step(now).end
        peak = max(peak, eng.num_running)
    assert peak == 2 and eng.stats.finished["length"] == 5


def test_preemption_by_recompute_when_blocks_run_out():
    eng = engine(num_blocks=12, block_size=16, max_model_len=160)
    reqs = [Request(str(i), 40, 60, prompt_ids=ids(40, i)) for i in range(3)]
    for r in reqs:
        eng.submit(r, 0.0)
    _, results = run(eng)
    assert eng.stats.num_preemptions >= 1
    assert any(res.preempted for res in results)
    assert all(r.num_output == 60 and r.finish_reason == "length" for r in reqs)
    assert eng.kv.usage() == 0.0


def test_cancel_frees_blocks_and_counts_abort():
    eng = engine()
    r = Request("a", 300, 100, block_hashes=[])
    eng.submit(r, 0.0)
    eng.step(0.0)
    assert eng.num_running == 1 and eng.kv_usage > 0
    assert eng.cancel("a", 0.5) and not eng.cancel("a", 0.5)
    assert eng.num_running == 0 and eng.kv_usage == 0.0 and not eng.has_work()
    assert r.finish_reason == "abort" and eng.stats.finished["abort"] == 1


def test_output_is_deterministic_per_seed_and_ascii_words():
    def out(seed: int) -> list[int]:
        eng = engine(seed=seed)
        r = Request("a", 10, 50, prompt_ids=list(b"hello sim!"))
        eng.submit(r, 0.0)
        run(eng)
        return r.output_ids

    a, b, c = out(1), out(1), out(2)
    assert a == b and a != c and len(a) == 50
    assert bytes(a).decode("ascii").replace(" ", "").isalpha()


def test_spec_decode_tokens_per_step_and_counters():
    k, a = 4, 0.8
    eng = engine(spec_tokens=k, spec_acceptance=a, seed=3)
    reqs = [Request(str(i), 20, 2000, block_hashes=[]) for i in range(8)]
    for r in reqs:
        eng.submit(r, 0.0)
    _, results = run(eng)
    st = eng.stats
    per_step = (st.spec_accepted_tokens + st.spec_drafts) / st.spec_drafts
    assert per_step == pytest.approx((1 - a ** (k + 1)) / (1 - a), rel=0.05)
    assert st.spec_draft_tokens <= k * st.spec_drafts
    assert all(r.num_output == 2000 for r in reqs)


class KinkedCost(LinearCost):
    """Not affine in the KV read: fast-forward must fall back to step-by-step sums."""

    def step_time_s(self, prefill_tokens: int, decode_seqs: int, kv_tokens_read: int) -> float:
        return 0.001 + 1e-4 * prefill_tokens + max(0.002, 2e-6 * kv_tokens_read)


@pytest.mark.parametrize("cost", [LinearCost(), KinkedCost()])
def test_fast_forward_matches_step_by_step(cost):
    def workload(fast: bool) -> list[tuple[float, int]]:
        eng = engine(block_size=16, cost=cost)
        reqs = [Request(str(i), 30 + 7 * i, 40 + 13 * i, block_hashes=[]) for i in range(6)]
        for r in reqs:
            eng.submit(r, 0.0)
        _, results = run(eng, fast=fast)
        if fast:
            assert any(res.steps > 1 for res in results)
        return [(r.finish_time, r.num_output) for r in reqs]

    slow, fast = workload(False), workload(True)
    assert [n for _, n in slow] == [n for _, n in fast]
    for (ts, _), (tf, _) in zip(slow, fast, strict=True):
        assert tf == pytest.approx(ts, rel=1e-9)


@pytest.mark.parametrize("limits", [dict(max_num_seqs=2), dict(num_blocks=14)])
def test_fast_forward_with_requests_waiting_matches_step_by_step(limits):
    """A full batch (or a full cache) keeps requests waiting: windows still fast-forward."""
    def workload(fast: bool) -> tuple[list[tuple[float, float, int]], int]:
        eng = engine(**{"num_blocks": 1000, "max_model_len": 200, **limits})
        reqs = [Request(str(i), 40 + 3 * i, 30 + 11 * i, block_hashes=[]) for i in range(6)]
        for r in reqs:
            eng.submit(r, 0.0)
        _, results = run(eng, fast=fast)
        if fast:
            assert any(res.steps > 1 for res in results)
        return [(r.first_token_time, r.finish_time, r.num_output) for r in reqs], eng.stats.num_preemptions

    (slow, p_slow), (fast, p_fast) = workload(False), workload(True)
    assert p_slow == p_fast
    for a, b in zip(slow, fast, strict=True):
        assert b[2] == a[2] and b[0] == pytest.approx(a[0], rel=1e-9) and b[1] == pytest.approx(a[1], rel=1e-9)


@pytest.mark.parametrize("cost", [LinearCost(), KinkedCost()])
def test_fast_forward_stops_at_until_like_single_steps(cost):
    def run_until(fast: bool) -> tuple[int, float]:
        eng = engine(cost=cost)
        r = Request("a", 10, 1000, block_hashes=[])
        eng.submit(r, 0.0)
        t = eng.step(0.0).end  # prefill
        if fast:
            res = eng.fast_forward(t, until=0.5)
            assert res.steps > 1
            return r.num_output, res.end
        while t < 0.5:
            t = eng.step(t).end
        return r.num_output, t

    (n_slow, t_slow), (n_fast, t_fast) = run_until(False), run_until(True)
    assert n_fast == n_slow and t_fast == pytest.approx(t_slow, rel=1e-9) and t_fast >= 0.5


def test_busy_engine_does_not_start_a_step_before_the_last_one_ends():
    eng = engine()
    eng.submit(Request("a", 100, 3, block_hashes=[]), 0.0)
    first = eng.step(0.0)
    second = eng.step(0.0)
    assert second.start == pytest.approx(first.end)


def test_eviction_events_are_recorded():
    eng = engine(num_blocks=8, block_size=16, record_kv_events=True)
    for i in range(3):
        eng.submit(Request(str(i), 64, 1, prompt_ids=ids(64, i)), 0.0)
        run(eng)
    events = eng.drain_kv_events()
    assert any(isinstance(e, BlockRemoved) for e in events)


def test_bad_requests_are_rejected():
    eng = engine(num_blocks=10, max_model_len=100)
    with pytest.raises(ValueError):
        eng.submit(Request("a", 100, 1, block_hashes=[]), 0.0)
    with pytest.raises(ValueError):
        eng.submit(Request("b", 10, 0, block_hashes=[]), 0.0)
    eng.submit(Request("c", 10, 5, block_hashes=[]), 0.0)
    with pytest.raises(ValueError):
        eng.submit(Request("c", 10, 5, block_hashes=[]), 0.0)


def test_no_request_is_scheduled_before_it_arrives():
    eng = engine()
    late = Request("late", 10, 2, block_hashes=[])
    eng.submit(late, 5.0)
    res = eng.step(0.0)  # idle engine: starts when the request is there
    assert res.start == 5.0 and late.first_token_time > 5.0
    busy = Request("busy", 10, 50, block_hashes=[])
    eng.submit(busy, 6.0)
    t = eng.step(6.0).end
    later = Request("later", 10, 2, block_hashes=[])
    eng.submit(later, t + 0.5)  # arrives in the future of the running engine
    res = eng.step(t)
    assert later.num_computed == 0 and eng.num_waiting == 1  # not admitted yet
    while later.first_token_time is None:
        res = eng.step(res.end)
    assert later.scheduled_time >= later.arrival
