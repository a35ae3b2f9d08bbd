"""What the KV-event subscriber follows: one :class:`EventSource` per replica (ZMQ endpoint,
replay endpoint, topic, connect or bind mode), its counters (:class:`ReplicaStats`), the
per-replica state the workers keep (:class:`Replica`), and the index writes the subscriber
needs (:class:`EventIndex`). Plain data; the I/O lives in :mod:`router.events_worker` and
:mod:`router.events`.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from router.core.kv_tracker import ReplicaTracker, SeqTracker

PROBE = -2  # queue item: check the engine's replay buffer (after a (re)connection)


class EventIndex(Protocol):
    """The index writes the subscriber needs (a subset of ``router.index.base.IndexBackend``)."""

    async def record(self, model: str, hashes: Sequence[int], replica: str, *, stored: bool = False) -> None: ...

    async def remove(self, replica: str, hashes: Sequence[int]) -> None: ...

    async def clear(self, replica: str) -> None: ...


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one replica's engine publishes its KV events."""

    replica: str
    model: str
    block_size: int
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    bind: bool | None = None  # None: bind when the endpoint's host is a wildcard

    @property
    def binds(self) -> bool:
        if self.bind is not None:
            return self.bind
        return "*" in self.endpoint or "::" in self.endpoint


@dataclass(slots=True)
class ReplicaStats:
    batches: int = 0
    events: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    decode_errors: int = 0
    clears: int = 0
    duplicates: int = 0
    index_errors: int = 0
    last_seq: int | None = None


@dataclass(slots=True)
class Replica:
    source: EventSource
    tracker: ReplicaTracker
    queue: asyncio.Queue[tuple[int, bytes]]
    seq: SeqTracker = field(default_factory=SeqTracker)
    stats: ReplicaStats = field(default_factory=ReplicaStats)
    replayed: tuple[int, int] = (1, 0)  # seq range the last replay delivered (empty)
    last_payload: bytes | None = None  # bytes of the last batch applied (engine identity check)
    suspect: bool = True  # state unknown (start, connection dropped): verify before continuing
    removed: bool = False


def check_topics(endpoint: str, sources: list[EventSource]) -> None:
    topics = [s.topic for s in sources]
    if len(sources) > 1 and ("" in topics or len(set(topics)) != len(topics)):
        raise ValueError(f"replicas sharing {endpoint} need distinct non-empty topics")

