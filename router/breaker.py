"""Per-replica circuit breakers fed by real requests (passive checks). Pure: time is passed in.

A replica's breaker is *closed* while its requests succeed. ``failure_threshold``
consecutive failed attempts (connect error, 5xx, a response the router could not read, a
stream that broke, stalled or ended without ``[DONE]``, a first-byte timeout) *open* it:
the replica gets no traffic for ``open_s`` seconds. Then it is *half-open*: one request at
a time is let through as a probe. A failed probe re-opens it (for another ``open_s``);
``success_threshold`` successful probes in a row close it. A 429 (busy) or a client that
went away counts as neither.

The proxy asks :meth:`Breakers.blocked` for the replicas to exclude before each routing
decision (the scheduler skips excluded replicas exactly as it skips ejected ones), calls
:meth:`Breakers.started` when an attempt is sent and :meth:`Breakers.finished` with its
outcome (``None`` when the attempt was cancelled). The pool's active health checks are
independent of this: either can take a replica out of rotation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUE = {CLOSED: 0, OPEN: 1, HALF_OPEN: 2}


@dataclass(slots=True)
class CircuitBreaker:
    """One replica's breaker (see module docstring)."""

    failure_threshold: int = 5
    open_s: float = 10.0
    success_threshold: int = 2
    state: str = CLOSED
    fails: int = 0
    oks: int = 0
    opened_at: float = 0.0
    probing: int = 0  # probes in flight while half-open
    opens: int = 0

    def allows(self, now: float) -> bool:
        """May a request be sent now? (Moves open -> half-open once ``open_s`` has passed.)"""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            if now - self.opened_at < self.open_s:
                return False
            self.state, self.oks, self.probing = HALF_OPEN, 0, 0
        return self.probing == 0

    def started(self, now: float) -> None:
        if self.state == HALF_OPEN:
            self.probing += 1

    def finished(self, ok: bool | None, now: float) -> str | None:
        """Record one attempt's outcome; returns the new state when it changed."""
        if self.state == HALF_OPEN and self.probing:
            self.probing -= 1
        if ok is None:
            return None
        if ok:
            self.fails = 0
            if self.state == HALF_OPEN:
                self.oks += 1
                if self.oks >= self.success_threshold:
                    self.state, self.oks = CLOSED, 0
                    return CLOSED
            return None
        self.oks = 0
        if self.state == HALF_OPEN:
            return self._open(now)
        if self.state == CLOSED:
            self.fails += 1
            if self.fails >= self.failure_threshold:
                return self._open(now)
        return None

    def _open(self, now: float) -> str:
        self.state, self.opened_at, self.fails, self.probing = OPEN, now, 0, 0
        self.opens += 1
        return OPEN


@dataclass(slots=True)
class Breakers:
    """The breakers of every replica, created on first use. ``on_change(replica, state)`` is
    called on every transition (metrics, logs)."""

    failure_threshold: int = 5
    open_s: float = 10.0
    success_threshold: int = 2
    enabled: bool = True
    on_change: Callable[[str, str], None] | None = None
    _b: dict[str, CircuitBreaker] = field(default_factory=dict)
    _not_closed: set[str] = field(default_factory=set)

    def get(self, replica: str) -> CircuitBreaker:
        b = self._b.get(replica)
        if b is None:
            b = self._b[replica] = CircuitBreaker(self.failure_threshold, self.open_s, self.success_threshold)
        return b

    def blocked(self, now: float) -> frozenset[str]:
        """Replicas that must not get a request now (open, or half-open with a probe out)."""
        if not self._not_closed:
            return frozenset()
        out = []
        for rid in list(self._not_closed):
            b = self._b[rid]
            before = b.state
            if not b.allows(now):
                out.append(rid)
            if b.state != before and self.on_change:
                self.on_change(rid, b.state)
        return frozenset(out)

    def started(self, replica: str, now: float) -> None:
        if self.enabled and replica in self._not_closed:
            self._b[replica].started(now)

    def finished(self, replica: str, ok: bool | None, now: float) -> None:
        if not self.enabled:
            return
        change = self.get(replica).finished(ok, now)
        if change is None:
            return
        if change == CLOSED:
            self._not_closed.discard(replica)
        else:
            self._not_closed.add(replica)
        if self.on_change:
            self.on_change(replica, change)

    def forget(self, replica: str) -> None:
        self._b.pop(replica, None)
        self._not_closed.discard(replica)

    def states(self) -> dict[str, str]:
        return {rid: b.state for rid, b in self._b.items()}
