"""The router's Prometheus metrics, on a per-app ``CollectorRegistry`` (never the global one).

Per-request metrics are counters and histograms whose labelled children are cached in
plain dicts (a ``labels()`` call takes a lock and builds a key; the hot path avoids it).
Pool-wide gauges (in-flight, health, engine load per replica) are read from the pool at
scrape time by a custom collector, so requests pay nothing for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.core.types import ReplicaState

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class _PoolCollector(Collector):
    def __init__(self, states: Callable[[], Iterable[ReplicaState]]) -> None:
        self._states = states

    def collect(self) -> Iterable[Metric]:
        inflight = GaugeMetricFamily("kvrouter_replica_in_flight", "Requests the router has in flight per replica",
                                     labels=["replica"])
        healthy = GaugeMetricFamily("kvrouter_replica_healthy", "1 when the replica is in rotation, 0 when ejected",
                                    labels=["replica"])
        running = GaugeMetricFamily("kvrouter_replica_engine_running", "Running requests the engine last reported",
                                    labels=["replica"])
        waiting = GaugeMetricFamily("kvrouter_replica_engine_waiting", "Queued requests the engine last reported",
                                    labels=["replica"])
        kv = GaugeMetricFamily("kvrouter_replica_kv_usage", "KV-cache usage (0-1) the engine last reported",
                               labels=["replica"])
        for s in self._states():
            inflight.add_metric([s.id], s.in_flight)
            healthy.add_metric([s.id], 1.0 if s.healthy else 0.0)
            running.add_metric([s.id], s.running)
            waiting.add_metric([s.id], s.waiting)
            kv.add_metric([s.id], s.kv_usage)
        yield from (inflight, healthy, running, waiting, kv)


class RouterMetrics:
    """Every metric the router exports. ``states`` is the pool's list of replica states."""

    def __init__(self, registry: CollectorRegistry, states: Callable[[], Iterable[ReplicaState]]) -> None:
        self.registry = registry
        self.requests = Counter("kvrouter_requests", "Requests by model, replica and HTTP status",
                                ["model", "replica", "status"], registry=registry)
        self.latency = Histogram("kvrouter_request_duration_seconds",
                                 "Total request latency as the router sees it (arrival to last byte)",
                                 ["model"], buckets=LATENCY_BUCKETS, registry=registry)
        self.ttft = Histogram("kvrouter_time_to_first_byte_seconds",
                              "Arrival to the first response byte sent to the client (TTFT for streams)",
                              ["model"], buckets=LATENCY_BUCKETS, registry=registry)
        self.overhead = Histogram("kvrouter_router_overhead_seconds",
                                  "Router-added latency: arrival to the upstream request being sent "
                                  "(parsing, auth, routing), excluding retry backoff",
                                  buckets=OVERHEAD_BUCKETS, registry=registry)
        self.retries = Counter("kvrouter_retries", "Upstream attempts retried on another replica, by reason",
                               ["model", "reason"], registry=registry)
        self.upstream_errors = Counter("kvrouter_upstream_errors", "Upstream failures by replica and kind",
                                       ["replica", "kind"], registry=registry)
        self.decisions = Counter("kvrouter_decisions", "Routing decisions by policy and reason",
                                 ["policy", "reason"], registry=registry)
        self.rejected = Counter("kvrouter_rejected", "Requests refused by the router itself, by reason",
                                ["reason"], registry=registry)
        self.ejections = Counter("kvrouter_replica_ejections", "Replicas taken out of rotation",
                                 ["replica"], registry=registry)
        registry.register(_PoolCollector(states))
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def request_done(self, model: str, replica: str, status: int, total_s: float, first_byte_s: float | None) -> None:
        self._child(self.requests, model, replica, str(status)).inc()
        self._child(self.latency, model).observe(total_s)
        if first_byte_s is not None:
            self._child(self.ttft, model).observe(first_byte_s)

    def decision(self, policy: str, reason: str) -> None:
        self._child(self.decisions, policy, reason).inc()

    def retry(self, model: str, reason: str) -> None:
        self._child(self.retries, model, reason).inc()

    def upstream_error(self, replica: str, kind: str) -> None:
        self._child(self.upstream_errors, replica, kind).inc()

    def reject(self, reason: str) -> None:
        self._child(self.rejected, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
