"""The ``weighted`` policy: a scheduler pipeline assembled from YAML.

    policy:
      name: weighted
      options:
        scorers: {load: 1.0, kv_usage: 0.5, queue: 0.0, prefix: 0.0}   # name: weight
        filters: {max_kv_usage: 0.95, max_load: null}                    # null/absent: off

Filters drop replicas (but never all of them: see :class:`~router.core.scheduler.Pipeline`);
each scorer gives every remaining replica a value in [0, 1], the framework sums
``weight × score`` and picks the best (ties at random). Scorers:

- ``load``: ``1 - L/max L`` over the candidates (:attr:`ReplicaState.load`; all equal → 1).
- ``kv_usage``: ``1 - kv_usage`` (free KV cache as the engine last reported it).
- ``queue``: ``1 - waiting/max waiting`` (the engine's queued requests).
- ``prefix``: matched blocks / prompt blocks (needs prefix matching: a positive weight makes
  the router tokenize and look up the index, as ``cache_aware`` does).

Pure; one file, one registration line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from router.core.scheduler import Pipeline, WeightedScorer
from router.core.types import ReplicaState, RoutingRequest


class _Scorer:
    def __init__(self, name: str, fn: Callable[[RoutingRequest, Sequence[ReplicaState], Mapping[str, int]],
                                              dict[str, float]]) -> None:
        self.name = name
        self._fn = fn

    def score(self, req: RoutingRequest, replicas: Sequence[ReplicaState],
              matches: Mapping[str, int]) -> dict[str, float]:
        return self._fn(req, replicas, matches)


def _load(req: RoutingRequest, reps: Sequence[ReplicaState], matches: Mapping[str, int]) -> dict[str, float]:
    top = max(r.load for r in reps)
    return {r.id: 1.0 if top <= 0 else 1.0 - r.load / top for r in reps}


def _kv(req: RoutingRequest, reps: Sequence[ReplicaState], matches: Mapping[str, int]) -> dict[str, float]:
    return {r.id: 1.0 - r.kv_usage for r in reps}


def _queue(req: RoutingRequest, reps: Sequence[ReplicaState], matches: Mapping[str, int]) -> dict[str, float]:
    top = max(r.waiting for r in reps)
    return {r.id: 1.0 if top <= 0 else 1.0 - r.waiting / top for r in reps}


def _prefix(req: RoutingRequest, reps: Sequence[ReplicaState], matches: Mapping[str, int]) -> dict[str, float]:
    n = len(req.hashes)
    return {r.id: (matches.get(r.id, 0) / n) if n else 0.0 for r in reps}


SCORERS: dict[str, Callable[..., dict[str, float]]] = {
    "load": _load, "kv_usage": _kv, "queue": _queue, "prefix": _prefix,
}


def _number(v: Any, key: str, lo: float = 0.0) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or v < lo:
        raise ValueError(f"policy.options.{key}: must be a number >= {lo}, got {v!r}")
    return float(v)


def build(options: Mapping[str, Any] | None = None) -> Pipeline:
    """The ``weighted`` pipeline from ``policy.options`` (errors name the option)."""
    o = dict(options or {})
    raw_scorers = o.get("scorers", {"load": 1.0, "kv_usage": 0.5})
    if not isinstance(raw_scorers, Mapping) or not raw_scorers:
        raise ValueError("policy.options.scorers: must map scorer names to weights")
    scorers = []
    for name, weight in raw_scorers.items():
        if name not in SCORERS:
            raise ValueError(f"policy.options.scorers.{name}: unknown scorer (known: {', '.join(SCORERS)})")
        w = _number(weight, f"scorers.{name}")
        if w > 0:
            scorers.append(WeightedScorer(_Scorer(name, SCORERS[name]), w))
    if not scorers:
        raise ValueError("policy.options.scorers: at least one weight must be > 0")
    raw_filters = o.get("filters") or {}
    if not isinstance(raw_filters, Mapping):
        raise ValueError("policy.options.filters: must be a mapping")
    filters = []
    for name, limit in raw_filters.items():
        if limit is None:
            continue
        if name == "max_kv_usage":
            cap = _number(limit, "filters.max_kv_usage")
            filters.append(lambda req, reps, cap=cap: [r for r in reps if r.kv_usage <= cap])
        elif name == "max_load":
            cap = _number(limit, "filters.max_load")
            filters.append(lambda req, reps, cap=cap: [r for r in reps if r.load < cap])
        else:
            raise ValueError(f"policy.options.filters.{name}: unknown filter (known: max_kv_usage, max_load)")
    needs_prefix = any(ws.scorer.name == "prefix" for ws in scorers)
    return Pipeline("weighted", scorers, filters, needs_prefix=needs_prefix)
