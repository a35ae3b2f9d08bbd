"""Redis Cluster for the shared index (``index.cluster: true``) and for shared load accounting.

The index's key schema already keeps everything one lookup touches under one hash tag
(``<ns>:{<model>}:...``, see :mod:`router.index.redis`), so a lookup is still ONE
``EVALSHA`` sent straight to the node that owns the model's slot: no proxy, no redirect on
the hot path. This module adds what a cluster needs around that:

* :func:`slot_of` — the key's hash slot (CRC16 of the hash tag, as Redis computes it);
* :class:`ClusterConnections` — the slot map (``CLUSTER SLOTS`` read from any seed node),
  one lean pipelined :class:`~router.index.resp.RespConnection` per node, and ``call`` /
  ``call_many`` that follow a ``MOVED``/``ASK`` reply once after re-reading the map
  (a resharding or a failover costs one extra round trip for the requests that meet it);
* :class:`SingleConnection` — the same interface over one plain Redis, so callers (the
  shared load accounting in :mod:`router.reservations`) do not care which they have;
* :class:`RedisClusterIndex` — :class:`~router.index.redis.RedisIndex` whose lookups and
  batched record writes go to the slot's node; ``remove``/``clear`` go through redis-py's
  cluster client. The ``<ns>:models`` set has no tag: it is one key on its own node.

Seeds come from the URL (``redis://[user:pass@]host:port``; more seeds as a comma list of
``host:port`` after the first, e.g. ``redis://h1:7000,h2:7000,h3:7000``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from redis.crc import key_slot

from router.index.redis import BUCKET_TARGET, GENERATIONS, LOOKUP_LUA, RECORD_LUA, RedisIndex, pack_hashes
from router.index.resp import RespConnection, RespError, encode_command, timed

SLOTS = 16384


def slot_of(key: bytes | str) -> int:
    """Redis Cluster hash slot of ``key`` (hash tags honoured)."""
    return int(key_slot(key.encode() if isinstance(key, str) else key))


def seed_urls(url: str) -> list[str]:
    """``redis://a:1,b:2`` → ``["redis://a:1", "redis://b:2"]`` (credentials and db kept)."""
    u = urlsplit(url)
    userinfo, _, hosts = u.netloc.rpartition("@")
    out = []
    for h in hosts.split(","):
        h = h.strip()
        if h:
            netloc = f"{userinfo}@{h}" if userinfo else h
            out.append(urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment)))
    return out


def cluster_client_kwargs(url: str, timeout_s: float) -> dict[str, Any]:
    """Keyword arguments for redis-py's ``RedisCluster`` (``remove``/``clear``) from the index
    URL: seed nodes as ``(host, port)``, the URL's (percent-decoded) user and password, and
    TLS for ``rediss://`` (certificates verified, host name checked, as for the lean
    connections of :mod:`router.index.resp`)."""
    seeds = seed_urls(url)
    if not seeds:
        raise ValueError(f"no Redis Cluster seed in {url!r}")
    first = urlsplit(seeds[0])
    if first.scheme not in ("redis", "rediss"):
        raise ValueError(f"unsupported Redis URL scheme {first.scheme!r} (redis:// or rediss://)")
    return {
        "startup_nodes": [(urlsplit(s).hostname or "127.0.0.1", urlsplit(s).port or 6379) for s in seeds],
        "username": unquote(first.username) if first.username else None,
        "password": unquote(first.password) if first.password is not None else None,
        "ssl": first.scheme == "rediss",
        "socket_timeout": max(1.0, timeout_s), "socket_connect_timeout": max(1.0, timeout_s),
        "decode_responses": False,
    }


def _node_url(seed: str, host: str, port: int) -> str:
    u = urlsplit(seed)
    userinfo, _, _ = u.netloc.rpartition("@")
    netloc = f"{userinfo}@{host}:{port}" if userinfo else f"{host}:{port}"
    return urlunsplit((u.scheme, netloc, "", "", ""))


def parse_slots(reply: Sequence[Any], seed: str) -> list[str]:
    """A ``CLUSTER SLOTS`` reply → slot → node URL (16384 entries; "" where unassigned)."""
    table = [""] * SLOTS
    for entry in reply:
        lo, hi, master = int(entry[0]), int(entry[1]), entry[2]
        host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
        url = _node_url(seed, host or urlsplit(seed).hostname or "127.0.0.1", int(master[1]))
        for s in range(lo, hi + 1):
            table[s] = url
    return table


def _redirect(reply: object) -> tuple[str, str, int] | None:
    """``MOVED 3999 127.0.0.1:6381`` / ``ASK ...`` → (kind, host, port); else None."""
    if isinstance(reply, RespError):
        parts = str(reply).split()
        if len(parts) == 3 and parts[0] in ("MOVED", "ASK"):
            host, _, port = parts[2].rpartition(":")
            return parts[0], host, int(port)
    return None


async def _gathered(futs: list[asyncio.Future[Any]], timeout: float) -> list[Any]:
    return [await timed(f, timeout) for f in futs]


class ClusterConnections:
    """Slot map plus one lean connection per master node."""

    def __init__(self, url: str, timeout_s: float = 0.25) -> None:
        self.seeds = seed_urls(url)
        if not self.seeds:
            raise ValueError(f"no Redis Cluster seed in {url!r}")
        self.timeout_s = timeout_s
        self._slots: list[str] = []
        self._conns: dict[str, RespConnection] = {}
        self._lock = asyncio.Lock()
        self.refreshes = 0

    async def refresh(self) -> None:
        """Re-read the slot map from the first seed (or known node) that answers."""
        last: Exception | None = None
        for seed in [*self.seeds, *self._conns]:
            try:
                conn = await self._open(seed)
                reply = await timed(conn.call("CLUSTER", "SLOTS"), self.timeout_s * 4)
                if isinstance(reply, RespError):
                    raise reply
                self._slots = parse_slots(reply, self.seeds[0])
                self.refreshes += 1
                return
            except Exception as exc:  # try the next seed
                last = exc
        raise ConnectionError(f"no Redis Cluster node answered CLUSTER SLOTS: {last}")

    async def _open(self, url: str) -> RespConnection:
        conn = self._conns.get(url)
        if conn is None or conn.closed:
            async with self._lock:
                conn = self._conns.get(url)
                if conn is None or conn.closed:
                    conn = self._conns[url] = await RespConnection.open(url, self.timeout_s)
        return conn

    async def node_for(self, slot: int) -> str:
        if not self._slots:
            await self.refresh()
        url = self._slots[slot]
        if not url:
            raise ConnectionError(f"slot {slot} is not served by any node")
        return url

    async def conn_for(self, key: bytes | str) -> RespConnection:
        return await self._open(await self.node_for(slot_of(key)))

    async def call(self, key: bytes | str, *args: bytes | str | int, timeout: float | None = None) -> Any:
        """Send one command to the node owning ``key``; follows one MOVED/ASK."""
        t = timeout or self.timeout_s
        conn = await self.conn_for(key)
        reply = await timed(conn.call(*args), t)
        red = _redirect(reply)
        if red is None:
            return reply
        kind, host, port = red
        if kind == "MOVED":
            await self.refresh()
        node = await self._open(_node_url(self.seeds[0], host, port))
        if kind == "ASK":
            asking = node.call("ASKING")  # its reply is read (in order) and ignored
            asking.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await timed(node.call(*args), t)

    async def call_many(self, key: bytes | str, commands: list[bytes], timeout: float) -> list[Any]:
        """A pipeline of encoded commands to ``key``'s node (all must share its slot)."""
        conn = await self.conn_for(key)
        replies = await _gathered(conn.call_many(commands), timeout)
        if any(_redirect(r) for r in replies):
            await self.refresh()
            conn = await self.conn_for(key)
            replies = await _gathered(conn.call_many(commands), timeout)
        return list(replies)

    async def load_scripts(self, *scripts: str) -> None:
        """``SCRIPT LOAD`` each script on every master in the slot map."""
        for url in sorted(set(self._slots) - {""}):
            conn = await self._open(url)
            await _gathered(conn.call_many([encode_command((b"SCRIPT", b"LOAD", s)) for s in scripts]),
                            self.timeout_s * 4)

    def drop(self, key: bytes | str | None = None) -> None:
        """Forget connections (all, or the one for ``key``'s node) after an error."""
        for url, conn in list(self._conns.items()):
            if key is None or (self._slots and self._slots[slot_of(key)] == url):
                conn.close()
                del self._conns[url]

    def close(self) -> None:
        self.drop()


class SingleConnection:
    """:class:`ClusterConnections`' interface over one plain Redis (keys ignored)."""

    def __init__(self, url: str, timeout_s: float = 0.25) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._conn: RespConnection | None = None
        self._lock = asyncio.Lock()

    async def _get(self) -> RespConnection:
        async with self._lock:
            if self._conn is None or self._conn.closed:
                self._conn = await RespConnection.open(self.url, self.timeout_s)
            return self._conn

    async def call(self, key: bytes | str, *args: bytes | str | int, timeout: float | None = None) -> Any:
        return await timed((await self._get()).call(*args), timeout or self.timeout_s)

    async def call_many(self, key: bytes | str, commands: list[bytes], timeout: float) -> list[Any]:
        conn = await self._get()
        return await _gathered(conn.call_many(commands), timeout)

    def drop(self, key: bytes | str | None = None) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        self.drop()


def connections(url: str, cluster: bool, timeout_s: float = 0.25) -> ClusterConnections | SingleConnection:
    return ClusterConnections(url, timeout_s) if cluster else SingleConnection(url, timeout_s)


class RedisClusterIndex(RedisIndex):
    """The shared index on a Redis Cluster (``index.cluster: true``); same contract."""

    def __init__(self, url: str, **kw: Any) -> None:
        from redis.asyncio.cluster import ClusterNode, RedisCluster
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        seeds = seed_urls(url)
        timeout_s = float(kw.get("timeout_s", 0.25))
        if "client" not in kw:
            ckw = cluster_client_kwargs(url, timeout_s)
            nodes = [ClusterNode(h, p) for h, p in ckw.pop("startup_nodes")]
            kw["client"] = RedisCluster(startup_nodes=nodes, retry=Retry(NoBackoff(), 1), **ckw)
        super().__init__(seeds[0], **kw)
        self.nodes = ClusterConnections(url, timeout_s)

    async def close(self) -> None:
        await super().close()
        self.nodes.close()

    async def lookup(self, model: str, hashes: Sequence[int]) -> dict[str, int]:
        if not hashes or not self._available():
            return {}
        keys, prefix = self._keys(model)
        packed = pack_hashes(hashes)
        try:
            raw = await self.nodes.call(keys[0], b"EVALSHA", self._lookup_sha, b"1", keys[0], packed, prefix)
            if isinstance(raw, RespError):
                if not str(raw).startswith("NOSCRIPT"):
                    raise raw
                await self.nodes.call(keys[0], b"SCRIPT", b"LOAD", LOOKUP_LUA)
                raw = await self.nodes.call(keys[0], b"EVALSHA", self._lookup_sha, b"1", keys[0], packed, prefix)
                if isinstance(raw, RespError):
                    raise raw
        except Exception as exc:  # any failure: route on load alone
            self.nodes.drop(keys[0])
            self._failed("lookup", exc)
            return {}
        self._ok()
        return {raw[i].decode(): raw[i + 1] for i in range(0, len(raw), 2)}

    async def _send_records(self, batch: list[tuple[str, bytes, str, bool]]) -> None:
        """One pipeline per model (one slot each), all sent at once; new model names too."""
        new_models = {m for m, _, _, _ in batch} - self._known_models
        by_model: dict[str, list[bytes]] = {}
        for model, packed, replica, every in batch:
            keys, prefix = self._keys(model)
            by_model.setdefault(model, []).append(encode_command((
                b"EVALSHA", self._record_sha, b"1", keys[0], replica, packed, prefix,
                self.capacity(replica), self.ttl_ms, GENERATIONS, BUCKET_TARGET, b"1" if every else b"0")))
        models_key = f"{self.ns}:models"
        jobs = [self._send_slot(self._keys(m)[0][0], cmds) for m, cmds in by_model.items()]
        if new_models:
            jobs.append(self.nodes.call_many(
                models_key, [encode_command((b"SADD", models_key, m)) for m in new_models], self.write_timeout_s))
        results = await asyncio.gather(*jobs)
        errors = [r for res in results for r in res if isinstance(r, RespError)]
        if errors:
            self.events.error("record")
        self._known_models.update(new_models)

    async def _send_slot(self, key: bytes, cmds: list[bytes]) -> list[Any]:
        try:
            replies = await self.nodes.call_many(key, cmds, self.write_timeout_s)
        except Exception:
            self.nodes.drop(key)
            raise
        retry = [c for c, r in zip(cmds, replies, strict=True)
                 if isinstance(r, RespError) and str(r).startswith("NOSCRIPT")]
        if retry:
            await self.nodes.call(key, b"SCRIPT", b"LOAD", RECORD_LUA, timeout=self.write_timeout_s)
            replies = await self.nodes.call_many(key, retry, self.write_timeout_s)
        return replies

    async def start(self) -> None:
        await super().start()
        with contextlib.suppress(Exception):
            await self.nodes.refresh()
            await self.nodes.load_scripts(LOOKUP_LUA, RECORD_LUA)  # no NOSCRIPT round trip later
