"""DNS discovery with an injected resolver: the real router (in process), three ``kvrouter
sim`` engines (processes), the real ``openai`` client sending traffic the whole time.

Replicas appear (probed before use) and vanish (drained: in-flight requests finish, no new
ones, index entries dropped) while requests flow; not one request fails. A resolver
failure keeps the members; a record that points at nothing never receives a request.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import openai
import pytest

from router.config import Config
from router.core.types import RoutingRequest
from router.discovery import dns_resolver, endpoint_id
from router.server import Server
from tests.support.services import free_port
from tests.support.sim import sim_factory  # noqa: F401 - fixture

MODEL = "llama-3.1-8b"
PROMPT = "You are a helpful assistant. Summarise the following text about KV caches. " * 4


class FakeDNS:
    """An injectable resolver: ``records`` is what the name resolves to right now."""

    def __init__(self) -> None:
        self.records: list[tuple[str, int]] = []
        self.fail = False
        self.calls = 0

    async def __call__(self, name: str, port: int) -> list[tuple[str, int]]:
        self.calls += 1
        if self.fail:
            raise OSError("simulated resolver outage")
        return list(self.records)


def dns_config(**discovery: Any) -> Config:
    return Config.from_dict({
        "listen": {"host": "127.0.0.1", "port": 0},
        "policy": {"name": "cache_aware"},
        "models": {MODEL: {"tokenizer": "builtin", "block_size": 16}},
        "discovery": {"mode": "dns", "name": "engines.kvrouter.test", "port": 8000, "models": [MODEL],
                      "interval_s": 0.2, **discovery},
        "health": {"interval_s": 0.5, "timeout_s": 2.0},
        "scrape": {"interval_s": 0.5},
        "logging": {"requests": False},
    })


async def wait_for(cond: Any, timeout: float = 20.0, msg: Any = None) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met in time {msg() if msg else ''}")
        await asyncio.sleep(0.05)


class Traffic:
    """Concurrent completions through the router until stopped; records every outcome."""

    def __init__(self, base_url: str, workers: int = 6) -> None:
        self.client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=30)
        self.workers = workers
        self.served: list[str] = []
        self.prompts: dict[str, list[str]] = {}
        self.errors: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _one(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                prompt = f"worker {i} request {n}: {PROMPT}"  # distinct first block: spread by load
                raw = await self.client.completions.with_raw_response.create(
                    model=MODEL, prompt=prompt, max_tokens=12)
                comp = raw.parse()
                assert comp.choices[0].text is not None
                replica = raw.headers.get("x-kvrouter-replica", "?")
                self.served.append(replica)
                self.prompts.setdefault(replica, []).append(prompt)
            except Exception as exc:  # every failure is a lost request
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._one(i)) for i in range(self.workers)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self.client.close()


async def test_replicas_added_and_removed_while_traffic_flows(sim_factory):  # noqa: F811
    sims = sim_factory(3, time_scale=1, num_blocks=2000, model=MODEL)
    eps = [("127.0.0.1", s.port) for s in sims]
    ids = [endpoint_id(*e) for e in eps]
    dns = FakeDNS()
    dns.records = [eps[0]]
    srv = Server(dns_config())
    srv.state.discovery.resolver = dns
    await srv.start()
    traffic = Traffic(srv.url)
    try:
        assert [r.cfg.id for r in srv.state.pool.replicas()] == [ids[0]]
        traffic.start()
        await wait_for(lambda: len(traffic.served) >= 10)

        # scale out: two new records; they are probed, then take traffic
        dns.records = eps[:]
        await wait_for(lambda: all(srv.state.pool.get(i) is not None and srv.state.pool.get(i).state.healthy
                                   for i in ids))
        mark = len(traffic.served)
        await wait_for(lambda: {ids[1], ids[2]} <= set(traffic.served[mark:]), msg=lambda: Counter(traffic.served[mark:]))

        # scale in: the first record vanishes while its requests are in flight
        dns.records = eps[1:]
        await wait_for(lambda: srv.state.pool.get(ids[0]) is None)
        removed_at = len(traffic.served)
        await asyncio.sleep(1.0)  # its in-flight requests finish (drain) ...
        sims[0].stop()  # ... then the engine goes away, as a terminating pod does
        await wait_for(lambda: len(traffic.served) >= removed_at + 30)
        # a request that was already on its way may still finish there; afterwards none goes there
        late = traffic.served[removed_at + 12:]
        assert ids[0] not in late, Counter(late)
        # its index entries were dropped: the index no longer names it
        for rid, expect in ((ids[0], False), (ids[1], True)):
            rreq = RoutingRequest(model=MODEL)
            await srv.state.prefix.annotate("/v1/completions", {"prompt": traffic.prompts[rid][0]}, rreq)
            assert rreq.hashes, "prompt hashed"
            matches = await srv.state.prefix.lookup(rreq)
            assert (rid in matches) is expect, (rid, matches)
    finally:
        await traffic.stop()
        await srv.stop()
    assert traffic.errors == [], traffic.errors[:5]
    counts = Counter(traffic.served)
    assert counts[ids[1]] > 0 and counts[ids[2]] > 0 and counts[ids[0]] > 0, counts


async def test_probe_before_use_and_resolver_outage(sim_factory):  # noqa: F811
    (sim,) = sim_factory(1, time_scale=0, model=MODEL)
    dead = ("127.0.0.1", free_port())  # a record whose engine is not there
    dns = FakeDNS()
    dns.records = [("127.0.0.1", sim.port), dead]
    srv = Server(dns_config())
    srv.state.discovery.resolver = dns
    await srv.start()
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=30)
    try:
        pool = srv.state.pool
        assert pool.get(endpoint_id(*dead)) is not None and not pool.get(endpoint_id(*dead)).state.healthy
        for i in range(20):
            raw = await client.completions.with_raw_response.create(model=MODEL, prompt=f"hello {i}", max_tokens=4)
            assert raw.headers["x-kvrouter-replica"] == endpoint_id("127.0.0.1", sim.port)
        assert srv.state.metrics.upstream_errors.values == {}  # nothing was ever sent to the dead one
        # the resolver fails: members are kept, traffic continues
        dns.fail = True
        calls = dns.calls
        await wait_for(lambda: dns.calls >= calls + 3)
        assert srv.state.discovery.failures >= 3 and "outage" in srv.state.discovery.last_error
        assert len(pool.replicas()) == 2
        comp = await client.completions.create(model=MODEL, prompt="still here", max_tokens=4)
        assert comp.choices
        # it answers again, with no records: the pool empties and requests get a clean 503
        dns.fail = False
        dns.records = []
        await wait_for(lambda: not pool.replicas())
        with pytest.raises(openai.APIStatusError) as ei:
            await client.completions.create(model=MODEL, prompt="nobody home", max_tokens=4)
        assert ei.value.status_code in (404, 503)
        assert isinstance(ei.value.body, dict) and "message" in ei.value.body
    finally:
        await client.close()
        await srv.stop()


async def test_system_resolver_returns_loopback_records():
    records = await dns_resolver("localhost", 8123)
    assert ("127.0.0.1", 8123) in records or ("::1", 8123) in records
