"""The simulated engine's KV-event publisher: vLLM's ``ZmqEventPublisher`` on the wire.

Configured with the same ``--kv-events-config`` JSON as vLLM::

    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
     "replay_endpoint": "tcp://*:5558", "topic": "", "buffer_steps": 10000, "hwm": 100000,
     "encoding": "map"}

``encoding`` (``map`` = newer vLLM, ``array`` = older vLLM / SGLang), ``drop_seqs`` (fault
injection for tests: those sequence numbers are buffered for replay but never sent, so a
subscriber sees a gap) and ``replay_limit`` (fault injection: a replay reply stops after that
many batches without its end marker, as vLLM's replay socket cuts a reply longer than its
ZMQ high-water mark) are the simulator's own keys; other unknown keys are ignored. As in vLLM the PUB socket *binds* when the
endpoint contains ``*`` or ``::`` or is ``ipc://`` / ``inproc://`` and *connects* otherwise
(to a router that binds one socket for many engines); the replay ROUTER socket always
binds. Each published batch gets the next sequence number (from 0) and is kept in a ring
of ``buffer_steps`` batches for replay: a client sends ``[b"", start_seq]`` and receives
``[b"", seq, payload]`` for every buffered batch with ``seq >= start_seq``, then
``[b"", -1, b""]``.

:func:`convert` maps the simulator's own event records (``backends.sim.kvcache``) to the
wire types of :mod:`backends.kv_events`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import zmq
import zmq.asyncio

from backends.kv_events import (
    ENCODINGS,
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    encode_payload,
    encode_seq,
    vllm_extra_keys,
)
from router.tasks import stop_task

log = logging.getLogger("kvrouter.sim.kv_events")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields the simulator honours (plus ``encoding``)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: str = "map"
    drop_seqs: tuple[int, ...] = ()  # fault injection: batches buffered for replay, never sent
    # fault injection: a replay reply stops after this many batches, without its end marker
    # (what vLLM's replay socket does to a reply longer than its high-water mark); 0 = none
    replay_limit: int = 0

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in raw.items() if k in known}
        if "drop_seqs" in kw:
            kw["drop_seqs"] = tuple(int(x) for x in kw["drop_seqs"])
        cfg = cls(**kw)
        if cfg.encoding not in ENCODINGS:
            raise ValueError(f"--kv-events-config encoding must be one of {', '.join(ENCODINGS)}")
        if cfg.publisher not in ("zmq", "null"):
            raise ValueError("--kv-events-config publisher must be zmq or null")
        if cfg.buffer_steps < 1:
            raise ValueError("--kv-events-config buffer_steps must be >= 1")
        if cfg.replay_limit < 0:
            raise ValueError("--kv-events-config replay_limit must be >= 0")
        return cfg


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind on a wildcard host or an ipc/inproc endpoint, else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def convert(events: Iterable[Any], medium: str = "GPU") -> list[KVEvent]:
    """The simulator's KV-cache event records → wire events (by type name, duck-typed)."""
    out: list[KVEvent] = []
    for ev in events:
        kind = type(ev).__name__
        if kind == "BlockStored":
            lora = getattr(ev, "lora_name", None)
            salt = getattr(ev, "cache_salt", None) if ev.parent_block_hash is None else None
            extra = (tuple(vllm_extra_keys(i, lora, salt) for i in range(len(ev.block_hashes)))
                     if lora or salt else None)  # as newer vLLM: LoRA name per block, salt on the first
            out.append(BlockStored(tuple(ev.block_hashes), ev.parent_block_hash, tuple(ev.token_ids),
                                   ev.block_size, None, medium, lora, extra))
        elif kind == "BlockRemoved":
            out.append(BlockRemoved(tuple(ev.block_hashes), medium))
        elif kind == "AllBlocksCleared":
            out.append(AllBlocksCleared())
    return out


class KVEventPublisher:
    """Publishes event batches over ZMQ PUB and serves replays on a ROUTER socket."""

    def __init__(self, config: KVEventsConfig, *, data_parallel_rank: int = 0,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.rank = data_parallel_rank
        self.clock = clock
        self.seq = 0  # the next sequence number
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        cfg = self.config
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if binds(cfg.endpoint):
            self._pub.bind(cfg.endpoint)
        else:
            self._pub.connect(cfg.endpoint)
        if cfg.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            # A ROUTER drops what does not fit its pipe: with ZMQ's default high-water mark
            # (1,000 messages, which vLLM keeps) the tail of a longer reply, end marker
            # included, was silently lost. Unbounded: one reply is at most the buffer.
            self._replay.setsockopt(zmq.SNDHWM, 0)
            self._replay.bind(cfg.replay_endpoint)
            self._task = asyncio.create_task(self._serve_replay())

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def publish(self, events: Sequence[KVEvent], ts: float | None = None, *,
                      send: bool = True) -> int:
        """Publish one batch; returns its sequence number. ``send=False`` only buffers it
        for replay (fault injection: the subscriber sees a sequence gap)."""
        seq = self.seq
        self.seq += 1
        batch = EventBatch(self.clock() if ts is None else ts, tuple(events), self.rank)
        payload = encode_payload(batch, self.config.encoding)
        self._buffer.append((seq, payload))
        if send and self._pub is not None and seq not in self.config.drop_seqs:
            await self._pub.send_multipart([self.config.topic.encode(), encode_seq(seq), payload])
        return seq

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            frames = await sock.recv_multipart()
            if len(frames) == 3:
                client, _, start_raw = frames
            elif len(frames) == 2:
                client, start_raw = frames
            else:
                log.warning("replay request with %d frames ignored", len(frames))
                continue
            if len(start_raw) != 8:
                log.warning("replay request with a %d-byte seq ignored", len(start_raw))
                continue
            start = int.from_bytes(start_raw, "big")
            limit = self.config.replay_limit
            sent = 0
            for seq, payload in list(self._buffer):
                if seq >= start:
                    if limit and sent >= limit:
                        break  # fault injection: cut short, no end marker
                    await sock.send_multipart([client, b"", encode_seq(seq), payload])
                    sent += 1
            else:
                await sock.send_multipart([client, b"", encode_seq(END_SEQ), b""])
