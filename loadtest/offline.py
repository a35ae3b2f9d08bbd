"""Offline replay: a discrete-event simulation of a routed fleet in virtual time.

Runs the router's own code — policies from ``router.core.scheduler.default_registry()``,
the in-memory prefix index ``router.core.prefix_index.PrefixIndex`` — in front of N copies
of the simulator's own engine model (``backends.sim.engine.EngineModel``) whose KV
capacity and step costs come from the planner's ``Roofline`` for (model, GPU, precision).
Nothing is copied: the same classes serve live traffic.

What the driver mirrors from the live router (``router/proxy.py``): for each arrival,
look up the prompt's block hashes in the index (policies with ``needs_prefix``), call
``policy.choose`` on replica snapshots, record the hashes for the chosen replica, hold an
in-flight count until the request's last token. Engine load (running, waiting, KV usage)
reaches the snapshots as the router's scraper sees it: refreshed every
``scrape_interval_s`` of virtual time (0 = always exact).

The trace's hash ids (``block_size`` tokens each, e.g. Mooncake's 512) become engine block
hashes (``engine_block_size``, 16 by default) without materializing tokens: sub-block ``j``
of trace block ``i`` is named by (the prefix chain key of block ``i``, ``j``) — exactly the
equalities real token blocks would have when prompts are built from the ids by
:class:`loadtest.traces.prompts.PromptBuilder` (same id and position → same tokens; a
partial block is a prefix of the full one).

Per policy: ``hit_rate`` (cached prompt tokens at first admission ÷ prompt tokens, what
``usage.prompt_tokens_details.cached_tokens`` reports live), TTFT percentiles, requests
per replica and ``load_imbalance`` (max/mean). Pure: no I/O, no clock (the CLI times the
runs); the CLI entry point and the plot are at the end.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from backends.planner import PlanInput, Roofline, get_gpu, get_model
from backends.sim.engine import EngineConfig, EngineModel, Request
from loadtest.hitrate import chain_keys, ideal_infinite, ideal_pooled_lru
from loadtest.summary import load_imbalance, percentile
from loadtest.traces.types import TraceRequest
from router.core.prefix_index import PrefixIndex
from router.core.scheduler import default_registry
from router.core.types import ReplicaState, RoutingRequest

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class OfflineConfig:
    """The simulated fleet and router (the ``--offline`` flags)."""

    replicas: int = 8
    gpu: str = "h100-80gb"
    model: str = "llama-3.1-8b"
    weight_dtype: str = "bf16"
    kv_dtype: str = "auto"
    tensor_parallel: int = 1
    engine_block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    scrape_interval_s: float = 1.0
    index_capacity_blocks: int | None = None  # None: each replica's real KV capacity
    index_ttl_s: float | None = None
    speed: float = 1.0
    seed: int = 0


@dataclass(slots=True)
class PolicyResult:
    policy: str
    hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    load_imbalance: float
    requests_per_replica: dict[str, int]
    prompt_tokens: int
    cached_tokens: int
    preemptions: int
    virtual_duration_s: float
    skipped: int
    ttfts: list[float] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"hit_rate": self.hit_rate, "ttft_p50_s": self.ttft_p50_s, "ttft_p90_s": self.ttft_p90_s,
                "ttft_p99_s": self.ttft_p99_s, "load_imbalance": self.load_imbalance,
                "requests_per_replica": self.requests_per_replica, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "preemptions": self.preemptions,
                "virtual_duration_s": self.virtual_duration_s, "skipped": self.skipped}


def roofline_for(cfg: OfflineConfig) -> Roofline:
    model = get_model(cfg.model)
    return Roofline(PlanInput(model=model, gpu=get_gpu(cfg.gpu), tensor_parallel=cfg.tensor_parallel,
                              weight_dtype=cfg.weight_dtype, kv_dtype=cfg.kv_dtype,
                              block_size=cfg.engine_block_size))


def engine_hashes(req: TraceRequest, engine_block_size: int) -> list[int]:
    """Engine block hashes of a trace request (see the module docstring)."""
    tb = req.block_size
    if tb % engine_block_size:
        raise ValueError(f"trace block size {tb} is not a multiple of the engine block size {engine_block_size}")
    ratio = tb // engine_block_size
    shift = max(1, ratio.bit_length())
    out: list[int] = []
    for i, k in enumerate(chain_keys(req.hash_ids)):
        n = req.block_tokens(i) // engine_block_size
        if n:
            base = (k & _MASK64) << shift
            out.extend(range(base, base + n))
        if n < ratio:
            break  # a partial block ends the chain of full engine blocks
    return out


class _Fleet:
    """The engines, the router's view of them, and the event queue of one run."""

    def __init__(self, cfg: OfflineConfig, roof: Roofline, max_model_len: int) -> None:
        self.cfg = cfg
        self.ids = [f"r{i}" for i in range(cfg.replicas)]
        ecfg = EngineConfig(num_blocks=roof.kv_capacity_blocks, block_size=cfg.engine_block_size,
                            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                            max_model_len=max_model_len, model=cfg.model, seed=cfg.seed)
        self.engines = [EngineModel(ecfg, roof) for _ in self.ids]
        self.states = [ReplicaState(id=rid, capacity_blocks=roof.kv_capacity_blocks) for rid in self.ids]
        self.scheduled = [False] * cfg.replicas
        self.last_scrape = float("-inf")

    def scrape(self, now: float) -> None:
        iv = self.cfg.scrape_interval_s
        if iv > 0 and now - self.last_scrape < iv:
            return
        self.last_scrape = now
        for st, eng in zip(self.states, self.engines, strict=True):
            st.running, st.waiting, st.kv_usage = float(eng.num_running), float(eng.num_waiting), eng.kv_usage


def simulate(requests: Sequence[TraceRequest], policy_name: str, cfg: OfflineConfig,
             roof: Roofline | None = None) -> PolicyResult:
    """Replay ``requests`` (in arrival order) through ``policy_name`` on the simulated fleet."""
    roof = roof or roofline_for(cfg)
    max_len = get_model(cfg.model).max_position_embeddings
    fleet = _Fleet(cfg, roof, max_len)
    policy = default_registry().create(policy_name, cfg.policy_options)
    needs_prefix = bool(getattr(policy, "needs_prefix", False))
    on_routed = getattr(policy, "on_routed", None)
    on_finished = getattr(policy, "on_finished", None)
    cap = cfg.index_capacity_blocks or roof.kv_capacity_blocks
    index = PrefixIndex(default_capacity=cap, ttl_s=cfg.index_ttl_s) if needs_prefix else None
    rng = random.Random(cfg.seed)
    ebs = cfg.engine_block_size
    speed = cfg.speed
    events: list[tuple[float, int, int, Any]] = []  # (time, seq, kind, payload)
    seq = 0
    STEP, DONE = 0, 1
    owner: dict[str, tuple[int, RoutingRequest]] = {}
    per_replica = dict.fromkeys(fleet.ids, 0)
    ttfts: list[float] = []
    prompt_tokens = cached_tokens = skipped = 0
    n = len(requests)
    i = 0
    now = 0.0
    inf = float("inf")
    while i < n or events:
        t_arr = requests[i].timestamp_s / speed if i < n else inf
        if events and events[0][0] < t_arr:
            now, _, kind, payload = heapq.heappop(events)
            if kind == STEP:
                e = payload
                eng = fleet.engines[e]
                if not eng.has_work():
                    fleet.scheduled[e] = False
                    continue
                res = eng.fast_forward(now, until=t_arr)
                for r in res.finished:
                    seq += 1
                    heapq.heappush(events, (res.end, seq, DONE, r))
                seq += 1
                heapq.heappush(events, (res.end, seq, STEP, e))
            else:
                r = payload
                e, rreq = owner.pop(r.req_id)
                fleet.states[e].in_flight -= 1
                if on_finished is not None:
                    on_finished(rreq, fleet.ids[e], True)
                if r.first_token_time is not None:
                    ttfts.append(r.first_token_time - r.arrival)
                prompt_tokens += r.prompt_len
                cached_tokens += r.cached_tokens
            continue
        # an arrival
        tr = requests[i]
        now = t_arr
        i += 1
        if tr.input_length < 1 or tr.input_length >= max_len:
            skipped += 1
            continue
        hashes = engine_hashes(tr, ebs)
        rreq = RoutingRequest(model=cfg.model, hashes=hashes if needs_prefix else [],
                              num_tokens=tr.input_length, block_size=ebs, session_key=tr.session_id,
                              request_id=str(i - 1))
        fleet.scrape(now)
        matches = index.lookup(hashes, now) if index is not None else {}
        d = policy.choose(rreq, fleet.states, matches, rng)
        e = fleet.ids.index(d.replica)
        if index is not None:
            index.record(hashes, d.replica, now)
        if on_routed is not None:
            on_routed(rreq, d)
        fleet.states[e].in_flight += 1
        per_replica[d.replica] += 1
        req = Request(req_id=str(i - 1), prompt_len=tr.input_length, max_tokens=max(1, tr.output_length),
                      block_hashes=hashes)
        owner[req.req_id] = (e, rreq)
        eng = fleet.engines[e]
        eng.submit(req, now)
        if not fleet.scheduled[e]:
            fleet.scheduled[e] = True
            seq += 1
            heapq.heappush(events, (max(now, eng.busy_until), seq, STEP, e))
    return PolicyResult(
        policy=policy_name,
        hit_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        ttft_p50_s=percentile(ttfts, 50), ttft_p90_s=percentile(ttfts, 90), ttft_p99_s=percentile(ttfts, 99),
        load_imbalance=load_imbalance(per_replica, fleet.ids),
        requests_per_replica=per_replica, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
        preemptions=sum(eng.stats.num_preemptions for eng in fleet.engines),
        virtual_duration_s=now, skipped=skipped, ttfts=ttfts)


def ideal_figures(requests: Sequence[TraceRequest], cfg: OfflineConfig, roof: Roofline) -> dict[str, Any]:
    """The trace's ideal hit rates; the pooled LRU is as large as the whole fleet's KV cache."""
    bs = requests[0].block_size if requests else cfg.engine_block_size
    fleet_tokens = roof.kv_capacity_blocks * cfg.engine_block_size * cfg.replicas
    pooled_blocks = fleet_tokens // bs
    return {"ideal_infinite_hit_rate": ideal_infinite(requests).token_rate,
            "ideal_pooled_hit_rate": ideal_pooled_lru(requests, pooled_blocks).token_rate,
            "ideal_pooled_capacity_blocks": pooled_blocks,
            "fleet_kv_tokens": fleet_tokens}
