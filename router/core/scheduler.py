"""The scheduling framework: filters → weighted scorers → picker, as in llm-d.

A :class:`Policy` turns (request, replica snapshots, prefix matches) into a
:class:`~router.core.types.Decision`. Most policies are a :class:`Pipeline`: filters drop
ineligible replicas, each scorer returns a value in [0, 1] per replica (clamped by the
framework), the framework sums ``weight × score``, and the picker chooses among the best.
Policies are registered by name in a :class:`Registry` that the router and the offline
simulator build the same way (``default_registry()``), so both run identical code.

Pure: randomness comes in as a ``random.Random`` and time as a float.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from router.core.types import Decision, NoReplicaError, ReplicaState, RoutingRequest


class Policy(Protocol):
    """A routing policy. Hooks other than ``choose`` are optional no-ops."""

    name: str
    needs_prefix: bool  # True when the router must tokenize, hash and look up the index

    def choose(
        self,
        req: RoutingRequest,
        replicas: Sequence[ReplicaState],
        matches: Mapping[str, int],
        rng: random.Random,
    ) -> Decision: ...


class BasePolicy:
    """Convenience base: no prefix needed, no-op hooks."""

    name = "base"
    needs_prefix = False

    def on_routed(self, req: RoutingRequest, decision: Decision) -> None:  # noqa: B027
        """Called after the decision was taken (before the request is sent)."""

    def on_finished(self, req: RoutingRequest, replica: str, ok: bool) -> None:  # noqa: B027
        """Called when the request's response has ended."""


Filter = Callable[[RoutingRequest, list[ReplicaState]], list[ReplicaState]]


class Scorer(Protocol):
    name: str

    def score(
        self, req: RoutingRequest, replicas: Sequence[ReplicaState], matches: Mapping[str, int]
    ) -> dict[str, float]: ...


def eligible(req: RoutingRequest, replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    """Healthy replicas serving the request's model that were not already tried."""
    out = [
        r
        for r in replicas
        if r.healthy and r.id not in req.exclude and (not r.models or req.model in r.models)
    ]
    if not out:
        raise NoReplicaError(f"no healthy replica for model {req.model!r}")
    return out


@dataclass(slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


class Pipeline(BasePolicy):
    """filters → weighted scorers → picker (highest total; ties broken by ``rng``)."""

    def __init__(
        self,
        name: str,
        scorers: Sequence[WeightedScorer],
        filters: Sequence[Filter] = (),
        reason: Callable[[RoutingRequest, ReplicaState, Mapping[str, int]], str] | None = None,
        needs_prefix: bool = False,
    ) -> None:
        self.name = name
        self.scorers = list(scorers)
        self.filters = list(filters)
        self.needs_prefix = needs_prefix
        self._reason = reason

    def choose(
        self,
        req: RoutingRequest,
        replicas: Sequence[ReplicaState],
        matches: Mapping[str, int],
        rng: random.Random,
    ) -> Decision:
        cands = eligible(req, replicas)
        for f in self.filters:
            kept = f(req, cands)
            cands = kept or cands  # a filter never empties the field
        totals = {r.id: 0.0 for r in cands}
        for ws in self.scorers:
            for rid, s in ws.scorer.score(req, cands, matches).items():
                if rid in totals:
                    totals[rid] += ws.weight * min(1.0, max(0.0, s))
        best = max(totals.values())
        top = [r for r in cands if totals[r.id] >= best - 1e-12]
        pick = top[0] if len(top) == 1 else top[rng.randrange(len(top))]
        matched = matches.get(pick.id, 0)
        reason = self._reason(req, pick, matches) if self._reason else self.name
        return Decision(
            replica=pick.id,
            reason=reason,
            policy=self.name,
            matched_blocks=matched,
            matched_tokens=matched * req.block_size,
            scores=totals,
        )


PolicyFactory = Callable[[Mapping[str, Any]], Any]


class Registry:
    """Policy name → factory(options) . One registration line per policy."""

    def __init__(self) -> None:
        self._factories: dict[str, PolicyFactory] = {}

    def register(self, name: str, factory: PolicyFactory) -> None:
        self._factories[name] = factory

    def names(self) -> list[str]:
        return sorted(self._factories)

    def create(self, name: str, options: Mapping[str, Any] | None = None) -> Any:
        try:
            factory = self._factories[name]
        except KeyError:
            raise ValueError(f"unknown policy {name!r}; known: {', '.join(self.names())}") from None
        return factory(dict(options or {}))


def default_registry() -> Registry:
    """Every built-in policy. Imported lazily so each policy stays one file."""
    from router.core import policies

    reg = Registry()
    policies.register_all(reg)
    return reg
