"""The shared index on a real 3-node Redis Cluster started by the test (no redis-cli needed).

Three ``redis-server --cluster-enabled yes`` processes on free loopback ports; the fixture
assigns the 16,384 slots with ``CLUSTER ADDSLOTSRANGE``, joins the nodes with
``CLUSTER MEET`` and waits for ``cluster_state:ok``. Models whose hash tags land on
different nodes are recorded and looked up through :class:`RedisClusterIndex`, and each
lookup is checked to be ONE command on the owning node (``cmdstat_evalsha`` deltas)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from router.core.hashing import block_hashes, seed_hash
from router.index.cluster import ClusterConnections, RedisClusterIndex, slot_of
from router.index.redis import model_tag
from tests.support.services import RedisServer, free_port

RANGES = [(0, 5460), (5461, 10922), (10923, 16383)]


def _cmd(port: int, *args: str) -> bytes:
    """One raw RESP command over a fresh socket (fixture setup only)."""
    payload = f"*{len(args)}\r\n".encode() + b"".join(
        f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        data = b""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            chunk = s.recv(65536)
            data += chunk
            if not chunk or data.endswith(b"\r\n") and _complete(data):
                break
        return data


def _complete(data: bytes) -> bool:
    if data[:1] == b"$":
        n = int(data[1:data.index(b"\r\n")])
        return n < 0 or len(data) >= data.index(b"\r\n") + 2 + n + 2
    return True


def _info(port: int, section: str) -> str:
    return _cmd(port, "INFO", section).decode(errors="replace")


@pytest.fixture(scope="module")
def cluster():
    nodes: list[RedisServer] = []
    buses: list[int] = []
    try:
        for _ in range(3):
            bus = free_port()
            buses.append(bus)
            srv = RedisServer(extra=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                     "--cluster-port", str(bus), "--cluster-node-timeout", "5000"])
            nodes.append(srv.start())
        for srv, (lo, hi) in zip(nodes, RANGES, strict=True):
            assert _cmd(srv.port, "CLUSTER", "ADDSLOTSRANGE", str(lo), str(hi)).startswith(b"+OK")
        for srv, bus in zip(nodes[1:], buses[1:], strict=True):  # bus port given: not port + 10000
            assert _cmd(nodes[0].port, "CLUSTER", "MEET", "127.0.0.1", str(srv.port), str(bus)).startswith(b"+OK")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in _cmd(n.port, "CLUSTER", "INFO").decode() for n in nodes):
                break
            time.sleep(0.1)
        else:
            raise RuntimeError("cluster did not reach cluster_state:ok")
        yield nodes
    finally:
        for srv in nodes:
            srv.stop()


def seeds(nodes: list[RedisServer]) -> str:
    return "redis://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes)


def chain(tag: int, n: int, model: str) -> list[int]:
    return block_hashes([tag + 1] + list(range(n * 4 - 1)), 4, seed_hash(model))


def node_of(nodes: list[RedisServer], key: str) -> RedisServer:
    s = slot_of(key)
    return next(n for n, (lo, hi) in zip(nodes, RANGES, strict=True) if lo <= s <= hi)


def evalsha_calls(port: int) -> int:
    for line in _info(port, "commandstats").splitlines():
        if line.startswith("cmdstat_evalsha:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


def models_on_three_nodes(nodes: list[RedisServer]) -> list[str]:
    """Model names whose index keys live on three different nodes."""
    found: dict[int, str] = {}
    for i in range(200):
        m = f"model-{i}"
        port = node_of(nodes, f"ns:{{{model_tag(m)}}}:meta").port
        found.setdefault(port, m)
        if len(found) == 3:
            return list(found.values())
    raise AssertionError("no spread of models over the nodes")


async def test_cluster_slot_map_matches_the_nodes(cluster) -> None:
    conns = ClusterConnections(seeds(cluster[:1]), timeout_s=2.0)  # one seed is enough
    try:
        await conns.refresh()
        for key in ("a", "{m}:x", "ns:{model-1}:meta", "zz"):
            url = await conns.node_for(slot_of(key))
            assert url.endswith(f":{node_of(cluster, key).port}")
    finally:
        conns.close()


async def test_cluster_record_and_lookup_one_round_trip(cluster) -> None:
    idx = RedisClusterIndex(seeds(cluster), namespace="ns", timeout_s=2.0, default_capacity=10_000)
    await idx.start()
    try:
        models = models_on_three_nodes(cluster)
        for j, m in enumerate(models):
            a = chain(j, 40, m)
            await idx.record(m, a[:30], "r0")
            await idx.record(m, a[:12], "r1")
        await idx.flush()
        assert idx.failures == 0 and idx.dropped == 0
        for j, m in enumerate(models):
            owner = node_of(cluster, f"ns:{{{model_tag(m)}}}:meta")
            before = {n.port: evalsha_calls(n.port) for n in cluster}
            got = await idx.lookup(m, chain(j, 40, m))
            after = {n.port: evalsha_calls(n.port) for n in cluster}
            assert got == {"r0": 30, "r1": 12}, m
            # exactly one EVALSHA, on the node owning the model's slot, none elsewhere
            assert {p: after[p] - before[p] for p in after} == {
                n.port: (1 if n is owner else 0) for n in cluster}
        assert await idx.lookup(models[0], chain(99, 5, models[0])) == {}
        # remove and clear go through redis-py's cluster client
        a0 = chain(0, 40, models[0])
        await idx.remove("r0", a0[20:30])
        assert (await idx.lookup(models[0], a0))["r0"] == 20
        await idx.clear("r1")
        for j, m in enumerate(models):
            assert "r1" not in await idx.lookup(m, chain(j, 40, m))
    finally:
        await idx.close()


async def test_cluster_moved_is_followed_after_a_stale_map(cluster) -> None:
    idx = RedisClusterIndex(seeds(cluster), namespace="ns2", timeout_s=2.0)
    await idx.start()
    try:
        m = models_on_three_nodes(cluster)[0]
        a = chain(7, 8, m)
        await idx.record(m, a, "r0")
        await idx.flush()
        # poison the map: every slot points at a node that does not own this model's slot
        key = f"ns2:{{{model_tag(m)}}}:meta"
        wrong = next(n for n in cluster if n is not node_of(cluster, key))
        idx.nodes._slots = [f"redis://127.0.0.1:{wrong.port}"] * 16384
        refreshes = idx.nodes.refreshes
        assert await idx.lookup(m, a) == {"r0": 8}
        assert idx.nodes.refreshes == refreshes + 1
    finally:
        await idx.close()


async def test_shared_load_on_the_cluster(cluster) -> None:
    from router.core.types import ReplicaState
    from router.reservations import SharedLoad

    a_states = [ReplicaState(id="r0", in_flight=2), ReplicaState(id="r1")]
    b_states = [ReplicaState(id="r0"), ReplicaState(id="r1", in_flight=1)]
    a = SharedLoad(seeds(cluster[2:]), lambda: a_states, namespace="cl", cluster=True, timeout_s=2.0)
    b = SharedLoad(seeds(cluster[:1]), lambda: b_states, namespace="cl", cluster=True, timeout_s=2.0)
    try:
        await a.sync()
        await b.sync()
        await a.sync()
        assert [s.reserved for s in a_states] == [0.0, 1.0]
        assert [s.reserved for s in b_states] == [2.0, 0.0]
        assert a.failures == b.failures == 0
    finally:
        await a.close()
        await b.close()


async def test_cluster_index_down_returns_empty(cluster) -> None:
    port = free_port()
    idx = RedisClusterIndex(f"redis://127.0.0.1:{port}", namespace="ns3", timeout_s=0.2, retry_s=0.2)
    try:
        await asyncio.wait_for(idx.start(), 10)
        assert await idx.lookup("m", chain(1, 4, "m")) == {}
        assert not idx.up
    finally:
        await idx.close()
