"""The shared prefix index in Redis: one round trip per lookup, batched writes, bounded memory.

Every router process (and the KV-events consumer) pointed at the same Redis and namespace
shares placements. Works with ``redis://`` and ``rediss://`` URLs (user/password in the
URL) through redis-py asyncio.

Key schema (``ns`` = ``index.namespace``; ``{model}`` is a Redis Cluster hash tag, so all
keys of one model live in one slot and one Lua script can reach them all)::

    <ns>:models                   set   model names with entries (for remove/clear)
    <ns>:{<model>}:meta           hash  per replica R: g:R generation, n:R blocks in it,
                                        w:R generations kept, b:R bucket count, c:R sweep cursor
    <ns>:{<model>}:<R>:<bucket>   hash  8-byte block hash (little-endian) -> generation

Bucketing: a block lives in bucket ``(low 24 bits of its hash) mod b:R``, with
``b:R = ceil(capacity / 64)``, so buckets hold ~64 entries and Redis stores them as
compact listpacks. A record carrying a capacity whose bucket count differs from ``b:R``
(``set_capacity`` after the first record: an engine's capacity is scraped a few seconds
after start) moves the replica's live entries to the new count first, in the same script
(a one-off O(entries + old bucket count) pass; stale entries are dropped on the way). Measured: ~15 bytes per (block,
replica) entry (``tests/contract/test_index_contract.py::test_redis_memory_per_entry``
asserts ≤ 40 B), so 64 replicas × 100,000 blocks take ~100 MB (≤ 256 MB at the bound)
instead of the ~1.3 GB of one key per block plus a per-replica sorted set.

Capacity and LRU without a sorted set (generations): a replica's capacity ``C`` is split
into ``w = min(8, C)`` generations of ``S = C // w`` blocks. Recording a block not in the
current generation writes it with the current generation number (a refresh moves it
forward); after ``S`` such writes the generation advances. Only blocks of the last ``w``
generations match, so a replica holds at most ``C`` live blocks and the least recently
recorded generation drops first (LRU at 1/8-capacity granularity). A chain is written
tail-first, so heads are never older than tails and present blocks stay prefix-closed;
the same argument makes "already in the current generation" prefix-closed, so a record
finds what it must write with a binary search (≤ 1 + log2 n ``HGET``s: a repeated or
growing prompt costs a few calls, not one per block). A removal breaks that (an engine
eviction can take blocks out of the middle of a chain whose tail is current), so a
``stored=True`` record (blocks an engine's KV event reports stored) checks every block
instead (one ``HGET`` each) and rewrites the holes; the router's own records keep the search. Stale entries are deleted by a sweep
that visits ``nb × new / 2S`` buckets per record (a full pass per two generations), so
memory stays ≤ (w+2)/w × C entries. ``clear(R)`` is O(1): it advances ``g:R`` by ``w``
(everything stale at once; the sweep deletes it later).

TTL backstop: every bucket a record writes gets ``PEXPIRE ttl``, and so does the meta hash;
a generation lasts at most ``ttl/2``, so blocks in use are rewritten (and renewed) at least
that often, while an idle model's keys vanish.

The scripts themselves are in :mod:`router.index.redis_scripts`.

Lookup: one ``EVALSHA`` (on a lean RESP connection, :mod:`router.index.resp`, because
redis-py's per-call CPU would eat the hot-path budget) whose data argument is the packed
hashes (8 bytes each); the script builds key names itself (declared key: the meta hash;
all others share its hash tag). It reads the meta hash, then probes block 1 of every
replica (one ``HGET`` each: a replica without it is done), and for each holder narrows
[1, n] with up to two pivots taken from the lengths already found for other replicas
(``has(L)``, then ``has(L+1)``: replicas sharing a system prompt, or all holding the chain,
cost ~3 ``HGET``s each), checks the last block, and binary-searches what is left (≤ 12 +
log2 n ``HGET``s per holder, ~3 + log2 n typically). So a lookup costs one cheap probe per replica plus O(log n) per replica
that holds block 1 — measured by ``loadtest/bench_lookup.py``. The search relies on present
blocks being prefix-closed, which records and engine evictions (tails first) keep; a block
removed from the middle of a held chain may go unnoticed.

Failures: a short socket timeout and a circuit breaker. When Redis is unreachable,
``lookup`` returns ``{}`` at once for ``retry_s`` seconds, writes are dropped (counted), one
log line is written, and the index resumes by itself when Redis answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from router.index.base import IndexEvents
from router.index.redis_scripts import (  # noqa: F401  (re-exported: scripts and helpers)
    BUCKET_TARGET,
    CLEAR_LUA,
    GENERATIONS,
    LOOKUP_LUA,
    RECORD_LUA,
    REMOVE_LUA,
    buckets_for,
    model_tag,
    pack_hashes,
)
from router.index.resp import RespConnection, RespError, encode_command, timed
from router.tasks import stop_task

log = logging.getLogger("kvrouter.index.redis")

class RedisIndex:
    """The shared index (``index.backend: redis``)."""

    def __init__(self, url: str, namespace: str = "kvrouter", ttl_s: float = 3600.0,
                 default_capacity: int = 100_000, capacities: Mapping[str, int] | None = None,
                 timeout_s: float = 0.25, retry_s: float = 1.0, batch_max: int = 256,
                 max_pending: int = 10_000, flush_interval_s: float = 0.005,
                 events: IndexEvents | None = None,
                 client: Any = None) -> None:
        self.url = url
        self.ns = namespace
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.default_capacity = int(default_capacity)
        self._capacity = {k: int(v) for k, v in (capacities or {}).items()}
        self.retry_s = retry_s
        self.batch_max = batch_max
        self.max_pending = max_pending
        self.flush_interval_s = flush_interval_s
        self.events = events or IndexEvents()
        self.client = client or aioredis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), decode_responses=False, health_check_interval=0)
        self.timeout_s = timeout_s
        self._lookup_sha = hashlib.sha1(LOOKUP_LUA.encode()).hexdigest().encode()
        self._conn: RespConnection | None = None
        self._conn_lock = asyncio.Lock()
        self._record_sha = hashlib.sha1(RECORD_LUA.encode()).hexdigest().encode()
        self._wconn: RespConnection | None = None
        self.write_timeout_s = max(5.0, timeout_s)
        self._remove = self.client.register_script(REMOVE_LUA)
        self._clear = self.client.register_script(CLEAR_LUA)
        self._prefix: dict[str, tuple[list[bytes], bytes]] = {}  # model -> ([meta key], key prefix)
        self._known_models: set[str] = set()
        # the last looked-up hash list, its length and packed bytes (set when its reply
        # arrives): the record that follows a routing decision passes the same list, so it is
        # packed once per request
        self._last_packed: tuple[Sequence[int] | None, int, bytes] = (None, 0, b"")
        # (model, packed hashes, replica) in arrival order -> check every block (``stored``);
        # a repeat within one batch window is written once (dict keys), so a hot prefix costs
        # one script run per window
        self._pending: dict[tuple[str, bytes, str], bool] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._down_until = 0.0
        self.up = True
        self.dropped = 0
        self.failures = 0

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._writer(), name="redis-index-writer")
        with contextlib.suppress(Exception):
            await self.client.ping()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.flush(), 2.0)
        await stop_task(self._task)
        self._task = None
        for conn in (self._conn, self._wconn):
            if conn is not None:
                conn.close()
        self._conn = self._wconn = None
        with contextlib.suppress(Exception):
            await self.client.aclose()

    # -- keys -------------------------------------------------------------------------
    def _keys(self, model: str) -> tuple[list[bytes], bytes]:
        k = self._prefix.get(model)
        if k is None:
            base = f"{self.ns}:{{{model_tag(model)}}}:"
            k = self._prefix[model] = ([f"{base}meta".encode()], base.encode())
        return k

    def capacity(self, replica: str) -> int:
        return self._capacity.get(replica, self.default_capacity)

    def set_capacity(self, replica: str, blocks: int) -> None:
        if blocks <= 0:
            raise ValueError("capacity must be positive")
        self._capacity[replica] = int(blocks)

    # -- circuit ----------------------------------------------------------------------
    def _available(self) -> bool:
        return self.up or time.monotonic() >= self._down_until

    def _failed(self, op: str, exc: BaseException) -> None:
        self.failures += 1
        self.events.error(op)
        self._down_until = time.monotonic() + self.retry_s
        if self.up:
            self.up = False
            self.events.availability(False)
            log.warning("redis index unreachable (%s: %s); routing on load alone until it answers",
                        op, exc.__class__.__name__)

    def _ok(self) -> None:
        if not self.up:
            self.up = True
            self.events.availability(True)
            log.warning("redis index reachable again; prefix routing resumed")

    # -- reads ------------------------------------------------------------------------
    async def lookup(self, model: str, hashes: Sequence[int]) -> dict[str, int]:
        if not hashes or not self._available():
            return {}
        keys, prefix = self._keys(model)
        packed = pack_hashes(hashes)
        try:
            conn = self._conn
            if conn is None or conn.closed:
                conn = await self._connect()
            raw = await self._call(conn, b"EVALSHA", self._lookup_sha, b"1", keys[0], packed, prefix)
            if isinstance(raw, RespError):
                if not str(raw).startswith("NOSCRIPT"):
                    raise raw
                await self._call(conn, b"SCRIPT", b"LOAD", LOOKUP_LUA)
                raw = await self._call(conn, b"EVALSHA", self._lookup_sha, b"1", keys[0], packed, prefix)
                if isinstance(raw, RespError):
                    raise raw
        except Exception as exc:  # any failure: route on load alone
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self._failed("lookup", exc)
            return {}
        self._ok()
        # set after the await: other lookups in flight meanwhile would have replaced it, and
        # the caller's record follows this return without yielding
        self._last_packed = (hashes, len(hashes), packed)
        return {raw[i].decode(): raw[i + 1] for i in range(0, len(raw), 2)}

    async def _connect(self) -> RespConnection:
        async with self._conn_lock:
            if not self._available():  # a caller ahead of us just failed: do not queue up
                raise ConnectionError("redis index unavailable")
            if self._conn is None or self._conn.closed:
                self._conn = await RespConnection.open(self.url, self.timeout_s)
            return self._conn

    async def _call(self, conn: RespConnection, *args: bytes | str) -> object:
        return await timed(conn.call(*args), self.timeout_s)

    # -- writes -----------------------------------------------------------------------
    def record_nowait(self, model: str, hashes: Sequence[int], replica: str, *, stored: bool = False) -> None:
        """Queue a record for the background writer (never blocks, never raises).
        ``stored``: the engine reports these blocks stored (a KV event), so each one not in
        the current generation is written, holes left by removals included; otherwise the
        record script binary-searches the already-current prefix (see module doc)."""
        if not hashes:
            return
        if len(self._pending) >= self.max_pending:
            del self._pending[next(iter(self._pending))]
            self.dropped += 1
            self.events.error("record")
        last, n, packed = self._last_packed
        key = (model, packed if hashes is last and len(hashes) == n else pack_hashes(hashes), replica)
        self._pending[key] = stored or self._pending.get(key, False)
        self._idle.clear()
        self._wake.set()

    async def record(self, model: str, hashes: Sequence[int], replica: str, *, stored: bool = False) -> None:
        self.record_nowait(model, hashes, replica, stored=stored)

    async def flush(self) -> None:
        """Wait until every queued record was written (or dropped)."""
        if self._task is None:
            await self._write_batch()
            return
        await self._idle.wait()

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            if self.flush_interval_s > 0:
                await asyncio.sleep(self.flush_interval_s)  # let a batch gather
            self._wake.clear()
            while self._pending:
                await self._write_batch()
            self._idle.set()

    async def _write_batch(self) -> None:
        if not self._pending:
            return
        it = iter(self._pending)
        keys = [next(it) for _ in range(min(self.batch_max, len(self._pending)))]
        batch = [(*k, self._pending.pop(k)) for k in keys]
        if not self._available():
            self.dropped += len(batch)
            self.events.error("record")
            return
        try:
            await self._send_records(batch)
        except Exception as exc:
            if self._wconn is not None:
                self._wconn.close()
                self._wconn = None
            self.dropped += len(batch)
            self._failed("record", exc)
            return
        self._ok()

    async def _send_records(self, batch: list[tuple[str, bytes, str, bool]]) -> None:
        """One pipelined write of every record script call (and new model names)."""
        conn = self._wconn
        if conn is None or conn.closed:
            conn = self._wconn = await RespConnection.open(self.url, self.timeout_s)
        new_models = {m for m, _, _, _ in batch} - self._known_models
        cmds = [encode_command((b"SADD", f"{self.ns}:models", m)) for m in new_models]
        calls = []
        for model, packed, replica, every in batch:
            keys, prefix = self._keys(model)
            calls.append(encode_command((b"EVALSHA", self._record_sha, b"1", keys[0], replica, packed, prefix,
                                         self.capacity(replica), self.ttl_ms, GENERATIONS, BUCKET_TARGET,
                                         b"1" if every else b"0")))
        async with asyncio.timeout(self.write_timeout_s):
            replies = await asyncio.gather(*conn.call_many(cmds + calls))
            retry = [c for c, r in zip(calls, replies[len(cmds):], strict=True)
                     if isinstance(r, RespError) and str(r).startswith("NOSCRIPT")]
            if retry:
                await conn.call_many([encode_command((b"SCRIPT", b"LOAD", RECORD_LUA))])[0]
                replies = await asyncio.gather(*conn.call_many(retry))
        errors = [r for r in replies if isinstance(r, RespError)]
        if errors:
            self.events.error("record")
            log.warning("redis index: %d record(s) failed: %s", len(errors), errors[0])
        self._known_models.update(new_models)

    async def _models(self) -> list[str]:
        return [m.decode() for m in await self.client.smembers(f"{self.ns}:models")]

    async def remove(self, replica: str, hashes: Sequence[int]) -> None:
        if not hashes or not self._available():
            return
        try:
            await self.flush()  # a record queued before this remove must not resurrect it
            packed = pack_hashes(hashes)
            for model in await self._models():
                keys, prefix = self._keys(model)
                await self._remove(keys=keys, args=[replica, packed, prefix])
        except Exception as exc:
            self._failed("remove", exc)
            return
        self._ok()

    async def clear(self, replica: str) -> None:
        if not self._available():
            return
        try:
            await self.flush()
            for model in await self._models():
                keys, _ = self._keys(model)
                await self._clear(keys=keys, args=[replica])
        except Exception as exc:
            self._failed("clear", exc)
            return
        self._ok()
