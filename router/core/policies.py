"""The simple load-balancing policies, and the list of every built-in policy.

Adding a policy is one new module in ``router/core/`` and one line in :func:`register_all`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from router.core.scheduler import BasePolicy, Registry, eligible
from router.core.types import Decision, ReplicaState, RoutingRequest


class RoundRobin(BasePolicy):
    """Each eligible replica in turn (per model), in pool order."""

    name = "round_robin"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self._next: dict[str, int] = {}

    def choose(self, req: RoutingRequest, replicas: Sequence[ReplicaState],
               matches: Mapping[str, int], rng: random.Random) -> Decision:
        cands = eligible(req, replicas)
        i = self._next.get(req.model, 0)
        self._next[req.model] = i + 1
        pick = cands[i % len(cands)]
        return Decision(replica=pick.id, reason="round_robin", policy=self.name)


class RandomPolicy(BasePolicy):
    """A uniformly random eligible replica."""

    name = "random"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        pass

    def choose(self, req: RoutingRequest, replicas: Sequence[ReplicaState],
               matches: Mapping[str, int], rng: random.Random) -> Decision:
        cands = eligible(req, replicas)
        pick = cands[rng.randrange(len(cands))]
        return Decision(replica=pick.id, reason="random", policy=self.name)


class LeastLoaded(BasePolicy):
    """The replica with the lowest load (ties: lowest KV usage, then random)."""

    name = "least_loaded"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        pass

    def choose(self, req: RoutingRequest, replicas: Sequence[ReplicaState],
               matches: Mapping[str, int], rng: random.Random) -> Decision:
        cands = eligible(req, replicas)
        best = min((r.load, r.kv_usage) for r in cands)
        top = [r for r in cands if (r.load, r.kv_usage) == best]
        pick = top[rng.randrange(len(top))] if len(top) > 1 else top[0]
        return Decision(replica=pick.id, reason="least_loaded", policy=self.name,
                        scores={r.id: -r.load for r in cands})


class PowerOfTwo(BasePolicy):
    """Two random eligible replicas; the less loaded of the pair."""

    name = "power_of_two"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        pass

    def choose(self, req: RoutingRequest, replicas: Sequence[ReplicaState],
               matches: Mapping[str, int], rng: random.Random) -> Decision:
        cands = eligible(req, replicas)
        if len(cands) == 1:
            return Decision(replica=cands[0].id, reason="power_of_two", policy=self.name)
        a, b = rng.sample(cands, 2)
        pick = a if (a.load, a.kv_usage) <= (b.load, b.kv_usage) else b
        return Decision(replica=pick.id, reason="power_of_two", policy=self.name)


def register_all(reg: Registry) -> None:
    """Register every built-in policy (one line each)."""
    reg.register("round_robin", RoundRobin)
    reg.register("random", RandomPolicy)
    reg.register("least_loaded", LeastLoaded)
    reg.register("power_of_two", PowerOfTwo)
    reg.register("session", __import__("router.core.session", fromlist=["x"]).SessionAffinity)
    reg.register("cache_aware", __import__("router.core.cache_aware", fromlist=["x"]).CacheAware)
    reg.register("weighted", __import__("router.core.weighted", fromlist=["x"]).build)
