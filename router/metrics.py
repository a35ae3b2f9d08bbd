"""The router's Prometheus metrics, on a per-app ``CollectorRegistry`` (never the global one).

Per-request metrics are counters and histograms kept in plain dicts and exported by a
custom collector at scrape time (prometheus-client's own metric objects take a lock and a
label lookup per update, several per request: measurable on the hot path).
Pool-wide gauges (in-flight, health, engine load per replica) are read from the pool at
scrape time by a custom collector, so requests pay nothing for them.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
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

    def describe(self) -> Iterable[Metric]:
        return list(self.collect())


class _Counter:
    """A labelled counter kept in a plain dict; exported at scrape time."""

    __slots__ = ("name", "doc", "labels", "values")

    def __init__(self, name: str, doc: str, labels: list[str]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, key: tuple[str, ...], amount: float = 1.0) -> None:
        self.values[key] = self.values.get(key, 0.0) + amount

    def family(self) -> Metric:
        fam = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for key, v in list(self.values.items()):
            fam.add_metric(list(key), v)
        return fam


class _Histogram:
    """A labelled histogram: per label set, one count per bucket plus the sum."""

    __slots__ = ("name", "doc", "labels", "bounds", "series")

    def __init__(self, name: str, doc: str, labels: list[str], buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.bounds = list(buckets)
        self.series: dict[tuple[str, ...], list[float]] = {}

    def observe(self, key: tuple[str, ...], value: float) -> None:
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = [0.0] * (len(self.bounds) + 2)  # buckets..., +Inf, sum
        s[bisect_left(self.bounds, value)] += 1
        s[-1] += value

    def family(self) -> Metric:
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for key, s in list(self.series.items()):
            cum, buckets = 0.0, []
            for bound, n in zip([*self.bounds, float("inf")], s[:-1], strict=True):
                cum += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cum))
            fam.add_metric(list(key), buckets, s[-1])
        return fam


class _Collector(Collector):
    def __init__(self, metrics: list[_Counter | _Histogram]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        for m in self._metrics:
            yield m.family()

    def describe(self) -> Iterable[Metric]:
        """The families (so the registry knows their names before any sample exists)."""
        return list(self.collect())


class RouterMetrics:
    """Every metric the router exports. ``states`` is the pool's list of replica states.

    Request-path metrics are plain-dict counters and histograms (no locks, no label
    lookups through prometheus-client on the hot path: the event loop is single-threaded),
    turned into Prometheus families when ``/metrics`` is scraped."""

    def __init__(self, registry: CollectorRegistry, states: Callable[[], Iterable[ReplicaState]]) -> None:
        self.registry = registry
        self.requests = _Counter("kvrouter_requests", "Requests by model, replica and HTTP status "
                                 "(499: client went away; 502/504 also for streams ended by an upstream failure)",
                                 ["model", "replica", "status"])
        self.latency = _Histogram("kvrouter_request_duration_seconds",
                                  "Total request latency as the router sees it (arrival to last byte)",
                                  ["model"], LATENCY_BUCKETS)
        self.ttft = _Histogram("kvrouter_time_to_first_byte_seconds",
                               "Arrival to the first response byte sent to the client (TTFT for streams)",
                               ["model"], LATENCY_BUCKETS)
        self.overhead = _Histogram("kvrouter_router_overhead_seconds",
                                   "Router-added latency: arrival to the upstream request being sent "
                                   "(parsing, auth, routing), first attempt", [], OVERHEAD_BUCKETS)
        self.retries = _Counter("kvrouter_retries", "Upstream attempts retried on another replica, by reason",
                                ["model", "reason"])
        self.upstream_errors = _Counter("kvrouter_upstream_errors", "Upstream failures by replica and kind",
                                        ["replica", "kind"])
        self.decisions = _Counter("kvrouter_decisions", "Routing decisions by policy and reason",
                                  ["policy", "reason"])
        self.rejected = _Counter("kvrouter_rejected", "Requests refused by the router itself, by reason",
                                 ["reason"])
        self.ejections = _Counter("kvrouter_replica_ejections", "Replicas taken out of rotation", ["replica"])
        registry.register(_Collector([self.requests, self.latency, self.ttft, self.overhead, self.retries,
                                      self.upstream_errors, self.decisions, self.rejected, self.ejections]))
        registry.register(_PoolCollector(states))

    def request_done(self, model: str, replica: str, status: int, total_s: float, first_byte_s: float | None) -> None:
        self.requests.inc((model, replica, str(status)))
        key = (model,)
        self.latency.observe(key, total_s)
        if first_byte_s is not None:
            self.ttft.observe(key, first_byte_s)

    def router_overhead(self, seconds: float) -> None:
        self.overhead.observe((), seconds)

    def decision(self, policy: str, reason: str) -> None:
        self.decisions.inc((policy, reason))

    def retry(self, model: str, reason: str) -> None:
        self.retries.inc((model, reason))

    def upstream_error(self, replica: str, kind: str) -> None:
        self.upstream_errors.inc((replica, kind))

    def reject(self, reason: str) -> None:
        self.rejected.inc((reason,))

    def ejection(self, replica: str) -> None:
        self.ejections.inc((replica,))

    def render(self) -> bytes:
        return generate_latest(self.registry)
