"""Glue between the router and its protections: circuit breakers, rate limits, connection caps.

The pure parts live in :mod:`router.breaker` and :mod:`router.ratelimit`, the listener in
:mod:`router.conn`; this module builds them from the config and exports their metrics on
the router's registry:

* ``kvrouter_breaker_state{replica}`` — 0 closed, 1 open, 2 half-open;
* ``kvrouter_breaker_opened{replica}`` — times the replica's breaker opened;
* ``kvrouter_connections_refused`` — connections refused over ``limits.max_connections``;
* rate-limited requests are counted in ``kvrouter_rejected{reason="rate_limited"}``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.breaker import STATE_VALUE, Breakers
from router.config import BreakerConfig, LimitsConfig
from router.ratelimit import RateLimiter


def breaker_outcome(status: int, retried: bool) -> bool | None:
    """An attempt's verdict for the breaker: False for a replica fault, True for a working
    replica (a 4xx is the client's error: the engine works), None for neither (429 busy; 499
    the client went away). See :func:`maybe_request_fault` for the 5xx answers whose verdict
    waits for the request's end."""
    if status in (429, 499):
        return None
    if retried:
        return False
    return status < 500


# 5xx answers an engine gives to a request it could not handle: the engine is up and answered,
# and the cause may be the request itself (a "poison" request that crashes the handler)
_MAYBE_REQUEST_FAULT = frozenset({500, 501, 505})


def maybe_request_fault(status: int) -> bool:
    """Is this engine answer one whose breaker verdict waits until the request ends
    (:func:`deferred_outcome`)? Connect errors, timeouts, broken streams, 502/503/504 are
    replica faults at once."""
    return status in _MAYBE_REQUEST_FAULT


def deferred_outcome(final_status: int) -> bool | None:
    """The verdict for the replicas that answered this request with a
    :func:`maybe_request_fault` status, once the request has ended with ``final_status``:
    False (their fault) when another replica then served it (2xx/3xx); None otherwise: a
    request that failed on every replica it was sent to (or that a replica called invalid, or
    whose client went away) tells nothing about the replicas, so a client repeating a poison
    request cannot open every breaker and take the pool down."""
    return False if 200 <= final_status < 400 else None


class _BreakerCollector(Collector):
    def __init__(self, breakers: Breakers) -> None:
        self._breakers = breakers

    def collect(self) -> Iterable[Metric]:
        state = GaugeMetricFamily("kvrouter_breaker_state", "Circuit breaker per replica: 0 closed, 1 open, "
                                  "2 half-open", labels=["replica"])
        opened = CounterMetricFamily("kvrouter_breaker_opened", "Times the replica's circuit breaker opened",
                                     labels=["replica"])
        for rid, b in list(self._breakers._b.items()):
            state.add_metric([rid], STATE_VALUE[b.state])
            opened.add_metric([rid], b.opens)
        yield state
        yield opened


def build_breakers(cfg: BreakerConfig, registry: CollectorRegistry | None,
                   log: logging.Logger | None = None) -> Breakers:
    lg = log or logging.getLogger("kvrouter.breaker")

    def changed(replica: str, state: str) -> None:
        lg.warning("replica %s circuit breaker %s", replica, state.replace("_", "-"))

    b = Breakers(cfg.failure_threshold, cfg.open_s, cfg.success_threshold, cfg.enabled, on_change=changed)
    if registry is not None:
        registry.register(_BreakerCollector(b))
    return b


def build_rate_limiter(limits: LimitsConfig) -> RateLimiter | None:
    if limits.rate_limit_rps <= 0:
        return None
    return RateLimiter(limits.rate_limit_rps, limits.rate_limit_burst or None)


def refused_counter(registry: CollectorRegistry) -> Counter:
    return Counter("kvrouter_connections_refused", "Client connections refused over limits.max_connections",
                   registry=registry)
