"""The KV-event subscriber: engines' ZMQ event streams → the shared prefix index.

One :class:`EventSubscriber` follows many engines. Each :class:`EventSource` (one per
replica) names a ZMQ ``endpoint``, an optional ``replay_endpoint`` and a ``topic``:

* connect mode (default): the engine binds its PUB socket (``tcp://*:5557`` on the engine)
  and the router connects a SUB socket to it (``tcp://engine-host:5557``);
* bind mode (``bind=True``, or an endpoint whose host is ``*`` / ``::``): the router binds one
  SUB socket and every engine connects its PUB to it (vLLM connects when its endpoint has
  no wildcard); sources sharing an endpoint share the socket and are told apart by topic.

Per replica, messages go through a bounded queue to one worker task that keeps the order.
Replay uses the engine's ROUTER socket: ``[b"", start_seq]`` out, ``[b"", seq, payload]``
frames back, then seq -1.

* Identity check: at start and after every reconnection (ZMQ socket monitor), and on a
  sequence gap or a sequence going backwards, the engine is asked to replay from the last
  batch applied. The same bytes back: same engine, the missed batches are applied.
  Anything else (engine restarted, buffer moved on, no replay socket): the replica is
  cleared and rebuilt from whatever contiguous history the engine's buffer holds.
* Events become index writes through the pure :class:`~router.core.kv_tracker.ReplicaTracker`
  (stored blocks re-hashed with the router's own chain), applied with ``record`` /
  ``remove`` / ``clear`` — all idempotent, so several consumers may run.
* A payload that cannot be decoded is logged (rate-limited) and counted, never fatal.

``reset_replica`` (health flap) and ``remove_replica`` (replica left the pool) clear the
replica at once; the index's ``clear`` is O(1) (per-replica generation). Metrics live in
:mod:`router.events_metrics`; the per-replica worker and the replay client in
:mod:`router.events_worker`; the source description and per-replica state in
:mod:`router.events_source`. This module keeps the orchestration: sockets, sources added
and dropped, the public controls.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Sequence

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry
from zmq.utils.monitor import parse_monitor_message

from backends.kv_events import KVEventDecodeError, decode_seq
from router.core.kv_tracker import ReplicaTracker, SeqTracker
from router.events_metrics import EventMetrics, TrackerCollector
from router.events_source import PROBE as _PROBE
from router.events_source import EventIndex, EventSource, ReplicaStats
from router.events_source import Replica as _Replica
from router.events_source import check_topics as _check_topics
from router.events_worker import ReplicaWorkers, log

__all__ = ["EventIndex", "EventSource", "EventSubscriber", "ReplicaStats", "log"]


class EventSubscriber(ReplicaWorkers):
    """Follows the KV events of many engines and writes them to ``index``."""

    def __init__(self, sources: Iterable[EventSource], index: EventIndex, *,
                 registry: CollectorRegistry | None = None, replay_timeout_s: float = 2.0,
                 queue_size: int = 10_000, clock: Callable[[], float] = time.time,
                 mediums: Sequence[str] = ("GPU", "gpu")) -> None:
        super().__init__(index, EventMetrics(registry or CollectorRegistry()),
                         replay_timeout_s=replay_timeout_s, clock=clock)
        self._mediums = tuple(mediums)
        self._queue_size = queue_size
        self._replicas: dict[str, _Replica] = {}
        for s in sources:
            if s.replica in self._replicas:
                raise ValueError(f"two event sources for replica {s.replica!r}")
            self._replicas[s.replica] = _Replica(
                s, ReplicaTracker(s.replica, s.model, s.block_size, mediums=mediums),
                asyncio.Queue(queue_size))
        self._groups = self._group_sockets()
        self.metrics.registry.register(TrackerCollector(self._replicas))
        self._tasks: list[asyncio.Task[None]] = []
        self._sockets: list[zmq.asyncio.Socket] = []
        # started sockets by (endpoint, binds): SUB socket, topic -> replica, its two tasks
        self._open: dict[tuple[str, bool], tuple[zmq.asyncio.Socket, zmq.asyncio.Socket,
                                                 dict[str, _Replica], list[asyncio.Task[None]]]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}

    def _group_sockets(self) -> dict[tuple[str, bool], list[_Replica]]:
        groups: dict[tuple[str, bool], list[_Replica]] = {}
        for r in self._replicas.values():
            groups.setdefault((r.source.endpoint, r.source.binds), []).append(r)
        for (ep, _), reps in groups.items():
            _check_topics(ep, [r.source for r in reps])
        return groups

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        for key, reps in self._groups.items():
            self._open_group(key, reps)
        for r in self._replicas.values():
            self._workers[r.source.replica] = asyncio.create_task(self._work(r))
            # rebuild from the replay buffer now: the socket monitor's first "connected" may
            # fire before the monitor is attached, and an idle engine sends nothing
            r.queue.put_nowait((_PROBE, b""))

    def _open_group(self, key: tuple[str, bool], reps: list[_Replica]) -> None:
        assert self._ctx is not None
        endpoint, binds = key
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        try:
            for r in reps:
                sock.setsockopt(zmq.SUBSCRIBE, r.source.topic.encode())
            if binds:
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError:
            sock.close(0)
            raise
        by_topic = {r.source.topic: r for r in reps}
        mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED)
        tasks = [asyncio.create_task(self._receive(sock, by_topic)), asyncio.create_task(self._watch(mon, reps))]
        self._sockets += [sock, mon]
        self._open[key] = (sock, mon, by_topic, tasks)

    async def close(self) -> None:
        tasks = [t for *_, ts in self._open.values() for t in ts] + list(self._workers.values()) + self._tasks
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        self._open = {}
        self._workers = {}
        for s in reversed(self._sockets):
            s.close(0)
        self._sockets = []
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # -- sources added and dropped while running (config reload) -----------------------
    def source(self, replica: str) -> EventSource | None:
        r = self._replicas.get(replica)
        return r.source if r is not None else None

    async def add_source(self, s: EventSource) -> None:
        """Follow ``s`` from now on (config reload). A replica already followed from the same
        source is kept as is (or followed again after ``remove_replica``); a changed source
        replaces the old one. The new source starts like the router does: the replica is
        cleared and rebuilt from the engine's replay buffer."""
        old = self._replicas.get(s.replica)
        if old is not None and old.source == s:
            if old.removed:
                old.removed = False
                await self._restart(old)
            return
        key = (s.endpoint, s.binds)
        group = self._groups.get(key, [])
        _check_topics(s.endpoint, [r.source for r in group if r.source.replica != s.replica] + [s])
        if old is not None:
            await self.drop_source(s.replica)
            group = self._groups.get(key, [])
        r = _Replica(s, ReplicaTracker(s.replica, s.model, s.block_size, mediums=self._mediums),
                     asyncio.Queue(self._queue_size))
        self._replicas[s.replica] = r
        group.append(r)
        self._groups[key] = group
        if self._ctx is None:  # not started: start() opens it
            return
        opened = self._open.get(key)
        if opened is None:
            deadline = time.monotonic() + 5.0
            while True:
                try:
                    self._open_group(key, group)
                    break
                except zmq.ZMQError as exc:  # a socket just closed on this endpoint lets go late
                    if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                        group.remove(r)
                        del self._replicas[s.replica]
                        if not group:
                            del self._groups[key]
                        raise
                    await asyncio.sleep(0.05)
        else:
            sock, _, by_topic, _ = opened
            sock.setsockopt(zmq.SUBSCRIBE, s.topic.encode())
            by_topic[s.topic] = r
        self._workers[s.replica] = asyncio.create_task(self._work(r))
        await self._restart(r)

    async def _restart(self, r: _Replica) -> None:
        """Start over for ``r``: clear it now; its next message (or the probe) rebuilds it
        from the engine's replay buffer."""
        await self._clear(r, "start")
        r.seq = SeqTracker()
        r.replayed = (1, 0)
        r.last_payload = None
        r.suspect = True
        await r.queue.put((_PROBE, b""))

    async def drop_source(self, replica: str) -> None:
        """Stop following ``replica`` for good (its ``kv_events`` left the config): clear its
        entries, unsubscribe, close the socket when no other replica shares it."""
        r = self._replicas.pop(replica, None)
        if r is None:
            return
        r.removed = True
        await self._clear(r, "removed")
        key = (r.source.endpoint, r.source.binds)
        group = self._groups.get(key, [])
        if r in group:
            group.remove(r)
        task = self._workers.pop(replica, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        opened = self._open.get(key)
        if opened is None:
            if not group:
                self._groups.pop(key, None)
            return
        sock, mon, by_topic, tasks = opened
        by_topic.pop(r.source.topic, None)
        if group:
            if r.source.topic not in {x.source.topic for x in group}:
                sock.setsockopt(zmq.UNSUBSCRIBE, r.source.topic.encode())
            return
        self._groups.pop(key, None)
        del self._open[key]
        if key[1]:
            with contextlib.suppress(zmq.ZMQError):
                sock.unbind(key[0])
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for sk in (mon, sock):
            sk.close(0)
            self._sockets.remove(sk)

    # -- public controls --------------------------------------------------------------
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def stats(self, replica: str) -> ReplicaStats:
        r = self._replicas[replica]
        r.stats.last_seq = r.seq.last
        return r.stats

    def tracker(self, replica: str) -> ReplicaTracker:
        return self._replicas[replica].tracker

    def follows(self, replica: str) -> bool:
        """True when this subscriber tracks ``replica``'s engine events."""
        r = self._replicas.get(replica)
        return r is not None and not r.removed

    async def reset_replica(self, replica: str, reason: str = "restart") -> None:
        """The engine restarted or flapped: its cache is gone; clear it now, keep following."""
        r = self._replicas.get(replica)
        if r is not None:
            await self._clear(r, reason)
            r.seq = SeqTracker()

    async def remove_replica(self, replica: str) -> None:
        """The replica left the pool: clear its entries and stop following its events."""
        r = self._replicas.get(replica)
        if r is not None and not r.removed:
            r.removed = True
            await self._clear(r, "removed")

    async def idle(self, timeout: float = 10.0) -> None:
        """Wait until every queued message has been applied (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while any(r.queue.qsize() or r.queue._unfinished_tasks for r in self._replicas.values()):  # type: ignore[attr-defined]
            if time.monotonic() > deadline:
                raise TimeoutError("event queues did not drain")
            await asyncio.sleep(0.01)

    # -- receiving --------------------------------------------------------------------
    async def _receive(self, sock: zmq.asyncio.Socket, by_topic: dict[str, _Replica]) -> None:
        while True:
            frames = await sock.recv_multipart()
            topic = frames[0].decode("utf-8", "replace") if frames else ""
            r = by_topic.get(topic)
            if r is None and len(by_topic) == 1:  # one engine on the socket, topic "": any topic
                single = next(iter(by_topic.values()))
                r = single if single.source.topic == "" else None
            if r is None:
                continue
            if r.removed:
                continue
            if len(frames) != 3:
                self._decode_error(r, f"message with {len(frames)} frames")
                continue
            try:
                seq = decode_seq(frames[1])
            except KVEventDecodeError as exc:
                self._decode_error(r, str(exc))
                continue
            await r.queue.put((seq, frames[2]))

    async def _watch(self, mon: zmq.asyncio.Socket, reps: list[_Replica]) -> None:
        """Connection events of one SUB socket. A publisher disconnecting (engine died or
        restarted, network) makes its replicas suspect; a (re)connection makes each suspect
        replica check the engine's replay buffer at once (messages published before the
        SUB socket reconnected are lost on the wire, and an idle engine may send no more)."""
        while True:
            frames = await mon.recv_multipart()
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                for r in reps:
                    r.suspect = True
            else:
                for r in reps:
                    if r.suspect and not r.removed:
                        await r.queue.put((_PROBE, b""))

