"""The ``cache_aware`` policy (the default): prefill saved against load, with a bounded-load guard.

For each eligible replica ``r`` with ``m_r`` matched tokens (from the prefix index) out of
the prompt's ``n`` tokens, load ``L_r`` (:attr:`ReplicaState.load`) and KV usage ``k_r``::

    bound   = ceil(c × (ΣL + 1) / N) + slack      # consistent hashing with bounded loads
    allowed = {r : L_r < bound}                   # never empty: the least loaded fits
    score_r = hit_weight × m_r/n − load_weight × L_r/bound − kv_weight × k_r

The pick is the allowed replica with the highest score. A prefix every request shares (a
hot system prompt) therefore fills its replica only up to ``c`` × the mean load, then
spills to the next best. ``slack`` (default 1 request) keeps the bound from being
tighter than one extra request at low load — without it, with 4 replicas and a single
request in flight (or a scraped engine count one interval stale) the bound is 1 and every
repeat of a prefix would be pushed off its replica; ``load_slack: 0`` gives the strict
bound. Requests that match nowhere go to the least-loaded allowed
replica; ties are broken by rendezvous hashing on the prompt's first block hash (spreads
distinct prompts, and two routers send the same new prompt to the same replica), or by the
``rng`` when there is no prompt hash.

Reasons: ``prefix_hit`` (the pick holds the longest match), ``load_guard`` (the longest
match sits on a replica above the bound), ``load`` (a better-matching replica lost on load
weight), ``cold`` (no match anywhere), ``no_prefix`` (the prompt could not be hashed).

Options (``policy.options``): ``balance_factor`` (c, default 1.25), ``load_slack`` (1),
``hit_weight`` (1.0),
``load_weight`` (0.5), ``kv_weight`` (0.2), ``min_match_blocks`` (1: fewer matched blocks
count as no match). Pure.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from router.core.scheduler import BasePolicy, eligible
from router.core.types import Decision, ReplicaState, RoutingRequest


def _float_opt(options: Mapping[str, Any], key: str, default: float, minimum: float = 0.0) -> float:
    v = options.get(key, default)
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"policy.options.{key}: must be a number, got {v!r}") from None
    if f < minimum or math.isnan(f):
        raise ValueError(f"policy.options.{key}: must be >= {minimum}, got {v!r}")
    return f


def load_bound(replicas: Sequence[ReplicaState], c: float, slack: float = 1.0) -> float:
    """The bounded-load ceiling: ``ceil(c × (total load + 1) / N) + slack`` (at least 1);
    a replica may take a request while its load is below it."""
    total = sum(r.load for r in replicas)
    return max(1.0, math.ceil(c * (total + 1.0) / len(replicas) - 1e-9) + slack)


def spread_pick(cands: Sequence[ReplicaState], key: int | None, rng: random.Random) -> ReplicaState:
    """One of ``cands``: rendezvous hashing on ``key`` when given, else random."""
    if len(cands) == 1:
        return cands[0]
    if key is None:
        return cands[rng.randrange(len(cands))]
    seed = key & 0xFFFFFFFFFFFFFFFF
    return max(cands, key=lambda r: xxhash.xxh3_64_intdigest(r.id.encode(), seed))


class CacheAware(BasePolicy):
    """Prefix-cache-aware routing with a bounded-load guard (see module docstring)."""

    name = "cache_aware"
    needs_prefix = True

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        o = dict(options or {})
        self.c = _float_opt(o, "balance_factor", 1.25, 1.0)
        self.slack = _float_opt(o, "load_slack", 1.0)
        self.hit_weight = _float_opt(o, "hit_weight", 1.0)
        self.load_weight = _float_opt(o, "load_weight", 0.5)
        self.kv_weight = _float_opt(o, "kv_weight", 0.2)
        self.min_match_blocks = int(_float_opt(o, "min_match_blocks", 1, 1))

    def choose(self, req: RoutingRequest, replicas: Sequence[ReplicaState],
               matches: Mapping[str, int], rng: random.Random) -> Decision:
        cands = eligible(req, replicas)
        bound = load_bound(cands, self.c, self.slack)
        allowed = [r for r in cands if r.load < bound] or cands
        key = req.hashes[0] if req.hashes else None
        bs = req.block_size
        best_all = 0
        if matches:
            best_all = max((matches.get(r.id, 0) for r in cands), default=0)
        if best_all < self.min_match_blocks:
            lo = min(r.load for r in allowed)
            ties = [r for r in allowed if r.load == lo]
            pick = spread_pick(ties, key, rng)
            return Decision(replica=pick.id, reason="cold" if req.hashes else "no_prefix",
                            policy=self.name, scores={r.id: -r.load / bound for r in cands})
        n_tokens = max(req.num_tokens, len(req.hashes) * bs, 1)
        hw, lw, kw = self.hit_weight, self.load_weight, self.kv_weight
        scores: dict[str, float] = {}
        for r in cands:
            m = matches.get(r.id, 0)
            if m < self.min_match_blocks:
                m = 0
            scores[r.id] = hw * min(1.0, m * bs / n_tokens) - lw * r.load / bound - kw * r.kv_usage
        top = max(scores[r.id] for r in allowed)
        ties = [r for r in allowed if scores[r.id] >= top - 1e-12]
        pick = spread_pick(ties, key, rng)
        matched = matches.get(pick.id, 0)
        if matched >= best_all:
            reason = "prefix_hit"
        elif any(matches.get(r.id, 0) >= best_all for r in allowed):
            reason = "load"
        else:
            reason = "load_guard"
        if matched < self.min_match_blocks:
            matched = 0
        return Decision(replica=pick.id, reason=reason, policy=self.name, matched_blocks=matched,
                        matched_tokens=min(matched * bs, n_tokens), scores=scores)
