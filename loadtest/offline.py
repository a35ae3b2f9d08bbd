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
from router.core.kv_tracker import apply_engine_events
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
    index_block_size: int | None = None  # None: the engine block size (as the live router's default)
    index_ttl_s: float | None = None
    speed: float = 1.0
    seed: int = 0
    tracking: str = "approx"  # approx: the router's own records; exact: plus the engines' KV events


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
    reasons: dict[str, int] = field(default_factory=dict)
    predicted_hit_rate: float = 0.0  # the router's own estimate: matched tokens at routing time
    ttfts: list[float] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"hit_rate": self.hit_rate, "ttft_p50_s": self.ttft_p50_s, "ttft_p90_s": self.ttft_p90_s,
                "ttft_p99_s": self.ttft_p99_s, "load_imbalance": self.load_imbalance,
                "requests_per_replica": self.requests_per_replica, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "preemptions": self.preemptions,
                "virtual_duration_s": self.virtual_duration_s, "skipped": self.skipped,
                "reasons": self.reasons, "predicted_hit_rate": self.predicted_hit_rate}


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
                            max_model_len=max_model_len, model=cfg.model, seed=cfg.seed,
                            record_kv_events=cfg.tracking == "exact")
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
    if not cfg.speed > 0:
        raise ValueError("speed must be > 0")
    roof = roof or roofline_for(cfg)
    max_len = get_model(cfg.model).max_position_embeddings
    fleet = _Fleet(cfg, roof, max_len)
    policy = default_registry().create(policy_name, cfg.policy_options)
    needs_prefix = bool(getattr(policy, "needs_prefix", False))
    on_routed = getattr(policy, "on_routed", None)
    on_finished = getattr(policy, "on_finished", None)
    ebs = cfg.engine_block_size
    ibs = cfg.index_block_size or ebs
    if ibs % ebs:
        raise ValueError(f"index block size {ibs} is not a multiple of the engine block size {ebs}")
    step = ibs // ebs
    if cfg.tracking == "exact" and step != 1:
        raise ValueError("exact tracking (engine KV events) needs the index block size to equal the engine's")
    cap = cfg.index_capacity_blocks or max(1, roof.kv_capacity_blocks // step)
    index = PrefixIndex(default_capacity=cap, ttl_s=cfg.index_ttl_s) if needs_prefix else None
    rng = random.Random(cfg.seed)
    speed = cfg.speed
    events: list[tuple[float, int, int, Any]] = []  # (time, seq, kind, payload)
    seq = 0
    STEP, DONE = 0, 1
    owner: dict[str, tuple[int, RoutingRequest]] = {}
    per_replica = dict.fromkeys(fleet.ids, 0)
    ttfts: list[float] = []
    prompt_tokens = cached_tokens = skipped = predicted = routed_tokens = 0
    reasons: dict[str, int] = {}
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
                if eng.kv.record_events:  # exact tracking: the engine's events reach the index
                    events_out = eng.drain_kv_events()
                    if index is not None:
                        apply_engine_events(index, fleet.ids[e], events_out, res.end)
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
        # the router's view: one hash per index block (the last engine block's names the prefix)
        ihashes = hashes if step == 1 else hashes[step - 1::step]
        rreq = RoutingRequest(model=cfg.model, hashes=ihashes if needs_prefix else [],
                              num_tokens=tr.input_length, block_size=ibs, session_key=tr.session_id,
                              request_id=str(i - 1))
        fleet.scrape(now)
        matches = index.lookup(ihashes, now) if index is not None else {}
        d = policy.choose(rreq, fleet.states, matches, rng)
        e = fleet.ids.index(d.replica)
        reasons[d.reason] = reasons.get(d.reason, 0) + 1
        predicted += min(d.matched_tokens, tr.input_length - 1)
        routed_tokens += tr.input_length
        if index is not None:
            index.record(ihashes, d.replica, now)
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
        virtual_duration_s=now, skipped=skipped, reasons=reasons,
        predicted_hit_rate=predicted / routed_tokens if routed_tokens else 0.0, ttfts=ttfts)


def ideal_figures(requests: Sequence[TraceRequest], cfg: OfflineConfig, roof: Roofline) -> dict[str, Any]:
    """The trace's ideal hit rates; the pooled LRU is as large as the whole fleet's KV cache."""
    bs = requests[0].block_size if requests else cfg.engine_block_size
    fleet_tokens = roof.kv_capacity_blocks * cfg.engine_block_size * cfg.replicas
    pooled_blocks = fleet_tokens // bs
    return {"ideal_infinite_hit_rate": ideal_infinite(requests).token_rate,
            "ideal_pooled_hit_rate": ideal_pooled_lru(requests, pooled_blocks).token_rate,
            "ideal_pooled_capacity_blocks": pooled_blocks,
            "fleet_kv_tokens": fleet_tokens}


def compare(requests: Sequence[TraceRequest], policies: Sequence[str], cfg: OfflineConfig,
            timer: Any = None, cpu_timer: Any = None) -> dict[str, Any]:
    """Every policy on the same trace and fleet, plus the trace's ideal figures, as one
    JSON-able object. ``timer`` / ``cpu_timer`` (zero-argument clocks, e.g.
    ``time.perf_counter`` / ``time.process_time``) add each run's ``wall_s`` / ``cpu_s``."""
    roof = roofline_for(cfg)
    out: dict[str, Any] = {
        "requests": len(requests), "replicas": cfg.replicas, "gpu": cfg.gpu, "model": cfg.model,
        "engine_block_size": cfg.engine_block_size, "kv_capacity_blocks_per_replica": roof.kv_capacity_blocks,
        "speed": cfg.speed, **ideal_figures(requests, cfg, roof), "policies": {}}
    results: dict[str, PolicyResult] = {}
    for p in policies:
        t0 = timer() if timer else 0.0
        c0 = cpu_timer() if cpu_timer else 0.0
        res = simulate(requests, p, cfg, roof)
        d = res.to_dict()
        ip = out["ideal_pooled_hit_rate"]
        d["fraction_of_ideal_pooled"] = res.hit_rate / ip if ip else None
        if timer:
            d["wall_s"] = timer() - t0
        if cpu_timer:
            d["cpu_s"] = cpu_timer() - c0
        out["policies"][p] = d
        results[p] = res
    out["_results"] = results
    return out


def plot(report: dict[str, Any], path: str) -> None:
    """Hit rate per policy (against the ideal figures) and the TTFT CDF per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results: dict[str, PolicyResult] = report["_results"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(results)
    ax1.bar(names, [results[n].hit_rate for n in names], color="tab:blue")
    ax1.axhline(report["ideal_pooled_hit_rate"], color="tab:orange", ls="--", label="ideal pooled LRU")
    ax1.axhline(report["ideal_infinite_hit_rate"], color="tab:green", ls=":", label="ideal infinite")
    ax1.set_ylabel("prefix hit rate (tokens)")
    ax1.set_title(f"{report['replicas']} × {report['gpu']}, {report['model']}")
    ax1.legend(loc="upper left", fontsize=8)
    for n in names:
        xs = sorted(results[n].ttfts)
        if xs:
            ax2.plot(xs, [(k + 1) / len(xs) for k in range(len(xs))], label=n)
    ax2.set_xscale("log")
    ax2.set_xlabel("TTFT (s, virtual time)")
    ax2.set_ylabel("fraction of requests")
    ax2.set_title("TTFT CDF")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_offline_cli(args: Any, requests: list[TraceRequest]) -> int:
    """``kvrouter replay --offline``: the table (or ``--json``) and ``--plot``."""
    import json
    import time

    names = [p.strip() for p in (args.policies or args.policy or "cache_aware").split(",") if p.strip()]
    known = default_registry().names()
    bad = [p for p in names if p not in known]
    if bad:
        raise ValueError(f"unknown policy {', '.join(bad)}; known: {', '.join(known)}")
    cfg = OfflineConfig(replicas=args.replicas, gpu=args.gpu, model=args.model or "llama-3.1-8b",
                        engine_block_size=args.engine_block_size, policy_options=dict(args.policy_option),
                        speed=args.speed, seed=args.seed, scrape_interval_s=max(0.0, args.scrape_interval),
                        index_capacity_blocks=args.index_capacity, index_block_size=args.index_block_size,
                        tracking=getattr(args, "tracking", "approx"))
    try:
        roofline_for(cfg)
    except Exception as exc:  # planner errors name the bad preset
        raise ValueError(str(exc)) from None
    report = compare(requests, names, cfg, timer=time.perf_counter, cpu_timer=time.process_time)
    if args.plot:
        plot(report, args.plot)
    report.pop("_results")
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['requests']:,} requests on {cfg.replicas} × {cfg.gpu} serving {cfg.model} "
          f"({report['kv_capacity_blocks_per_replica']:,} KV blocks of {cfg.engine_block_size} tokens each)")
    print(f"ideal hit rate: pooled LRU {report['ideal_pooled_hit_rate']:.3f}, "
          f"infinite {report['ideal_infinite_hit_rate']:.3f}")
    print(f"{'policy':<16}{'hit rate':>9}{'of ideal':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'imbalance':>10}{'wall s':>8}{'cpu s':>7}")
    for p, d in report["policies"].items():
        frac = d["fraction_of_ideal_pooled"]
        print(f"{p:<16}{d['hit_rate']:>9.3f}{(frac if frac is not None else 0):>9.2f}"
              f"{d['ttft_p50_s']:>10.3f}{d['ttft_p99_s']:>10.3f}{d['load_imbalance']:>10.3f}{d['wall_s']:>8.1f}"
              f"{d['cpu_s']:>7.1f}")
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0
