"""Prometheus metrics of the KV-event subscriber (on the registry it is given, never the
global one): counters and the lag histogram, plus per-replica tracker state read at scrape
time. Names are listed in docs/kv-events.md."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class EventMetrics:
    """Counters and the lag histogram of one subscriber."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        def c(name: str, doc: str, labels: Sequence[str] = ("replica",)) -> Counter:
            return Counter(name, doc, list(labels), registry=registry)

        self.events = c("kvrouter_kv_events_received", "Engine KV events received", ("replica", "type"))
        self.batches = c("kvrouter_kv_event_batches_received", "Engine KV event batches (ZMQ messages) received")
        self.gaps = c("kvrouter_kv_event_gaps", "Sequence gaps detected in an engine's event stream")
        self.replays = c("kvrouter_kv_event_replays", "Replays requested from an engine, by result",
                         ("replica", "result"))
        self.decode_errors = c("kvrouter_kv_event_decode_errors", "Event messages that could not be decoded")
        self.clears = c("kvrouter_kv_event_clears", "Replica entries cleared, by reason", ("replica", "reason"))
        self.index_errors = c("kvrouter_kv_event_index_errors", "Index writes from events that failed")
        self.lag = Histogram("kvrouter_kv_event_lag_seconds",
                             "Engine storing a block (batch timestamp) to the index knowing it",
                             buckets=LAG_BUCKETS, registry=registry)
        self.stale_removals = c("kvrouter_kv_event_stale_removals_skipped",
                                "Evicted blocks not removed: the router recorded them after the eviction")
        self.approx_expired = c("kvrouter_kv_event_approx_expired_blocks",
                                "Blocks the router recorded itself that no engine event confirmed in time")


class TrackerCollector(Collector):
    """Per-replica tracker state, read at scrape time."""

    def __init__(self, replicas: Mapping[str, Any]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterable[Metric]:
        held = GaugeMetricFamily("kvrouter_kv_event_engine_blocks",
                                 "Engine blocks the tracker maps to router blocks", labels=["replica"])
        skipped = CounterMetricFamily("kvrouter_kv_event_blocks_skipped",
                                      "Stored blocks not indexed (unknown parent, other medium or group, "
                                      "unsupported block size)", labels=["replica", "reason"])
        seq = GaugeMetricFamily("kvrouter_kv_event_last_seq", "Last sequence number applied", labels=["replica"])
        for rid, r in self._replicas.items():
            st = r.tracker.stats
            held.add_metric([rid], len(r.tracker))
            skipped.add_metric([rid, "unknown_parent"], st.unknown_parent)
            skipped.add_metric([rid, "other"], st.skipped)
            seq.add_metric([rid], -1 if r.seq.last is None else r.seq.last)
        yield from (held, skipped, seq)
