"""The ``session`` policy: consistent hashing with bounded loads on a session key.

``RoutingRequest.session_key`` (set by the router from the header named by
``policy.options.session_header``, default ``x-session-id``, else the body's ``user``) is
hashed onto a ring of ``vnodes`` virtual nodes per eligible replica; the request goes to the
first replica clockwise whose load is below ``ceil(c × (total load + 1) / N) + slack``
(Mirrokni et al., "Consistent Hashing with Bounded Loads"). A session stays on its replica
(and its KV cache) until that replica is over the bound or leaves the pool; only the
sessions of a departed replica move. Requests without a key go to the least-loaded replica.

Reasons: ``session`` (home replica), ``load_guard`` (home over the bound: next on the
ring), ``no_session``. Options: ``balance_factor`` (c, 1.25), ``load_slack`` (1; see
:mod:`router.core.cache_aware`), ``vnodes`` (64). Pure; the
ring is rebuilt only when the set of eligible replicas changes.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from router.core.cache_aware import _float_opt, load_bound, spread_pick
from router.core.scheduler import BasePolicy, eligible
from router.core.types import Decision, ReplicaState, RoutingRequest


class SessionAffinity(BasePolicy):
    """Sticky sessions on a consistent-hash ring with a bounded-load guard."""

    name = "session"
    needs_prefix = False

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        o = dict(options or {})
        self.c = _float_opt(o, "balance_factor", 1.25, 1.0)
        self.slack = _float_opt(o, "load_slack", 1.0)
        self.vnodes = int(_float_opt(o, "vnodes", 64, 1))
        self._ring_ids: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, ids: tuple[str, ...]) -> None:
        if ids == self._ring_ids:
            return
        pts = sorted((xxhash.xxh3_64_intdigest(f"{rid}#{v}".encode()), rid)
                     for rid in ids for v in range(self.vnodes))
        self._points = [p for p, _ in pts]
        self._owners = [o for _, o in pts]
        self._ring_ids = ids

    def choose(self, req: RoutingRequest, replicas: Sequence[ReplicaState],
               matches: Mapping[str, int], rng: random.Random) -> Decision:
        cands = eligible(req, replicas)
        bound = load_bound(cands, self.c, self.slack)
        scores = {r.id: -r.load / bound for r in cands}
        if not req.session_key:
            lo = min(r.load for r in cands)
            pick = spread_pick([r for r in cands if r.load == lo], None, rng)
            return Decision(replica=pick.id, reason="no_session", policy=self.name, scores=scores)
        by_id = {r.id: r for r in cands}
        self._ring(tuple(sorted(by_id)))
        h = xxhash.xxh3_64_intdigest(req.session_key.encode("utf-8", "surrogatepass"))
        n = len(self._points)
        i = bisect.bisect_left(self._points, h) % n
        seen: set[str] = set()
        home: str | None = None
        for step in range(n):
            rid = self._owners[(i + step) % n]
            if rid in seen:
                continue
            seen.add(rid)
            if home is None:
                home = rid
            if by_id[rid].load < bound:
                return Decision(replica=rid, reason="session" if rid == home else "load_guard",
                                policy=self.name, scores=scores)
            if len(seen) == len(by_id):
                break
        pick = min(cands, key=lambda r: r.load)
        return Decision(replica=pick.id, reason="load_guard", policy=self.name, scores=scores)
