"""The per-replica side of the KV-event subscriber: one worker task per replica applies its
queued messages in order, checks sequence numbers, and asks the engine's ROUTER socket to
replay (``[b"", start_seq]`` out, ``[b"", seq, payload]`` frames back, then seq -1) to fill
gaps or to check the engine is still the same one after a reconnection.

:class:`ReplicaWorkers` is the base of :class:`router.events.EventSubscriber`, which owns the
sockets and the replicas; this part turns one replica's messages into index writes through
the pure :class:`~router.core.kv_tracker.ReplicaTracker`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import zmq
import zmq.asyncio

from backends.kv_events import (
    END_SEQ,
    BlockStored,
    EventBatch,
    KVEventDecodeError,
    decode_payload,
    decode_seq,
    encode_seq,
)
from router.core.kv_tracker import SeqTracker
from router.events_metrics import EventMetrics
from router.events_source import PROBE as _PROBE
from router.events_source import EventIndex
from router.events_source import Replica as _Replica

log = logging.getLogger("kvrouter.events")

REPLAY_GAP_S = 0.5  # silence after batches of a replay have arrived: the reply was cut short


class ReplicaWorkers:
    """Applies each replica's queued KV-event messages to ``index`` (in order, with replays)."""

    def __init__(self, index: EventIndex, metrics: EventMetrics, *, replay_timeout_s: float,
                 clock: Callable[[], float]) -> None:
        self.index = index
        self.replay_timeout_s = replay_timeout_s
        self.clock = clock
        self.metrics = metrics
        self._ctx: zmq.asyncio.Context | None = None
        self._last_log = 0.0
        # (replica, router hashes, engine batch ts) -> the hashes to really remove; set by
        # router.exact_index.ExactAwareIndex to skip evictions older than its own records.
        self.removal_filter: Callable[[str, Sequence[int], float], list[int]] | None = None

    def _decode_error(self, r: _Replica, why: str) -> None:
        r.stats.decode_errors += 1
        self.metrics.decode_errors.labels(r.source.replica).inc()
        now = time.monotonic()
        if now - self._last_log > 5.0:  # at most one line per 5 s
            self._last_log = now
            log.warning("kv events: undecodable message from %s: %s", r.source.replica, why)

    # -- per-replica worker -----------------------------------------------------------
    async def _work(self, r: _Replica) -> None:
        while True:
            seq, payload = await r.queue.get()
            try:
                if r.removed:
                    pass
                elif seq == _PROBE:
                    if r.suspect:
                        await self._probe(r)
                else:
                    await self._handle(r, seq, payload)
            except Exception:  # never let one bad message stop the replica's stream
                log.exception("kv events: failed to apply a message from %s", r.source.replica)
            finally:
                r.queue.task_done()

    async def _probe(self, r: _Replica) -> None:
        """Same engine as before (our last batch replays byte for byte)? Then apply what was
        missed; otherwise clear and rebuild from the engine's buffer."""
        r.suspect = False
        if r.seq.last is not None and await self._replay(r, r.seq.last, verify=r.last_payload):
            return
        await self._clear(r, "start" if r.seq.last is None else "resync")
        r.seq = SeqTracker()
        r.replayed = (1, 0)
        await self._replay(r, 0)

    async def _handle(self, r: _Replica, seq: int, payload: bytes) -> None:
        lo, hi = r.replayed
        if lo <= seq <= hi and not r.suspect:  # already delivered by the last replay
            r.stats.duplicates += 1
            return
        verdict = r.seq.check(seq)
        if verdict == "gap":
            r.stats.gaps += 1
            self.metrics.gaps.labels(r.source.replica).inc()
        if verdict in ("gap", "old") or (r.suspect and verdict == "next"):
            # Missing batches, a sequence going backwards, or a reconnection: ask the engine
            # to replay from the last batch applied. Same engine (that batch comes back byte
            # for byte): the missing ones are applied. Otherwise (restart, buffer moved on,
            # no replay socket) the replica's state is unknown: start over.
            verdict = "next" if await self._replay(r, r.seq.last or 0, verify=r.last_payload) else "first"
        r.suspect = False
        if verdict == "first":
            # First message, engine restart, or events lost for good: clear the replica,
            # then rebuild from whatever contiguous history the engine's buffer still has
            # (blocks whose parents predate it are skipped, never guessed).
            await self._clear(r, "start" if r.seq.last is None else "resync")
            r.seq = SeqTracker()
            r.replayed = (1, 0)
            if seq > 0:
                await self._replay(r, 0)
        verdict = r.seq.check(seq)
        if verdict == "old":  # a replay delivered it
            r.stats.duplicates += 1
            return
        if verdict == "gap":  # the buffer did not reach this message: start over from it
            await self._clear(r, "gap")
            r.seq = SeqTracker()
        r.seq.accept(seq)
        r.last_payload = payload
        if seq > r.replayed[1]:
            r.replayed = (1, 0)
        await self._apply_payload(r, payload)

    async def _apply_payload(self, r: _Replica, payload: bytes, *, live: bool = True) -> None:
        try:
            batch = decode_payload(payload)
        except KVEventDecodeError as exc:
            self._decode_error(r, str(exc))
            return
        await self._apply(r, batch, live=live)

    async def _apply(self, r: _Replica, batch: EventBatch, *, live: bool = True) -> None:
        rid = r.source.replica
        r.stats.batches += 1
        r.stats.events += len(batch.events)
        self.metrics.batches.labels(rid).inc()
        for ev in batch.events:
            self.metrics.events.labels(rid, type(ev).__name__).inc()
        ops = r.tracker.apply(batch)
        try:
            for op in ops:
                if op.kind == "record":
                    # stored: every block checked (a removal may have holed a current chain)
                    await self.index.record(op.model or r.source.model, op.hashes, rid, stored=True)
                elif op.kind == "remove":
                    hashes = op.hashes
                    if self.removal_filter is not None:
                        hashes = self.removal_filter(rid, hashes, batch.ts)
                        if len(hashes) < len(op.hashes):
                            self.metrics.stale_removals.labels(rid).inc(len(op.hashes) - len(hashes))
                    if hashes:
                        await self.index.remove(rid, hashes)
                else:
                    await self.index.clear(rid)
                    r.stats.clears += 1
                    self.metrics.clears.labels(rid, "engine").inc()
        except Exception as exc:
            r.stats.index_errors += 1
            self.metrics.index_errors.labels(rid).inc()
            log.warning("kv events: index write for %s failed: %s", rid, exc)
            return
        if live and any(isinstance(ev, BlockStored) for ev in batch.events):  # replays are old news
            self.metrics.lag.observe(max(0.0, self.clock() - batch.ts))

    async def _clear(self, r: _Replica, reason: str) -> None:
        r.tracker.reset()
        r.stats.clears += 1
        self.metrics.clears.labels(r.source.replica, reason).inc()
        try:
            await self.index.clear(r.source.replica)
        except Exception as exc:
            r.stats.index_errors += 1
            self.metrics.index_errors.labels(r.source.replica).inc()
            log.warning("kv events: clearing %s failed: %s", r.source.replica, exc)

    # -- replay -------------------------------------------------------------------------
    async def _replay(self, r: _Replica, start: int, *, verify: bytes | None = None) -> bool:
        """Apply the engine's buffered batches from ``start`` on, while they follow on.

        With ``verify``: the first batch must be ``start`` (the last one applied) with
        exactly these bytes, else nothing is applied and False is returned. Without it, the
        replica was just cleared and any contiguous run of batches is history worth
        applying. True when the replay ran to its end marker.

        A replay cut short after some progress (the engine dropped frames at a full pipe:
        a hole, or no end marker before the timeout) is asked again from the batch after the
        last one applied; it ends when a round brings nothing new."""
        ep = r.source.replay_endpoint
        if not ep or self._ctx is None:
            self.metrics.replays.labels(r.source.replica, "unavailable").inc()
            return False
        first: int | None = None
        while True:
            result, got, verified = await self._replay_once(r, ep, start, verify)
            first = got if first is None else first
            if result == "ok" or r.seq.last is None or (got is None and not verified):
                break
            start, verify = r.seq.last + 1, None  # same engine, some progress: ask for the rest
        if first is not None and r.seq.last is not None:
            # Live messages up to here may arrive again on the SUB socket: skip them.
            r.replayed = (first, r.seq.last)
        return result == "ok"

    async def _replay_once(self, r: _Replica, ep: str, start: int,
                           verify: bytes | None) -> tuple[str, int | None, bool]:
        """One replay request: ``(result, first seq applied or None, verified)``."""
        assert self._ctx is not None
        rid = r.source.replica
        r.stats.replays += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # A replay is up to the engine's whole buffer (vLLM: 10,000 batches) sent at once,
        # while this task applies each batch before reading the next. ZMQ drops (ROUTER) or
        # stalls at the high-water mark — 1,000 messages on each side by default — so with
        # bounded pipes everything past ~2,000 batches, end marker included, was lost and the
        # replay failed or came back holed. Unbounded here: the I/O thread drains the
        # engine's pipe as fast as it can, memory bounded by the engine's buffer.
        sock.setsockopt(zmq.RCVHWM, 0)
        first: int | None = None
        verified = False
        result, why = "ok", ""
        try:
            sock.connect(ep)
            await sock.send_multipart([b"", encode_seq(start)])
            while True:
                # the first answer may take a while; once batches flow, a pause this long means
                # the engine cut the reply short (vLLM drops past its high-water mark and then
                # sends nothing more): end the round early and ask for the rest
                wait = self.replay_timeout_s if first is None and not verified else \
                    min(self.replay_timeout_s, REPLAY_GAP_S)
                frames = await asyncio.wait_for(sock.recv_multipart(), wait)
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if not frames:
                    continue
                seq = decode_seq(frames[0])
                if seq == END_SEQ:
                    if verify is not None:
                        result = "mismatch"  # the engine no longer has our last batch
                    break
                body = frames[1] if len(frames) > 1 else b""
                if verify is not None:
                    if seq != start or body != verify:
                        result = "mismatch"
                        break
                    verify = None
                    verified = True
                    continue
                last = r.seq.last
                if last is not None and seq <= last:
                    continue
                if last is not None and seq != last + 1:
                    result = "incomplete"  # a hole: stop here
                    break
                r.seq.accept(seq)
                r.last_payload = body
                first = seq if first is None else first
                await self._apply_payload(r, body, live=False)
        except (TimeoutError, KVEventDecodeError, zmq.ZMQError) as exc:
            result = "failed"
            why = str(exc) or (("no batch after the verified one" if verified else "no answer") +
                               " within the timeout" if isinstance(exc, TimeoutError) else type(exc).__name__)
        finally:
            sock.close(0)
        label = result
        if result in ("failed", "incomplete") and first is not None:
            label = "partial"  # batches applied, then cut short: the caller asks for the rest
            log.info("kv events: replay from %s cut short after batch %s (%s); asking for the rest", rid,
                     r.seq.last, why or "a hole")
        elif result != "ok":
            r.stats.replay_failures += 1
            if result == "failed":
                log.warning("kv events: replay from %s failed: %s", rid, why)
        self.metrics.replays.labels(rid, label).inc()
        return result, first, verified
