"""Shared fixtures: a real Redis-protocol server per test session, started on a free port."""

from __future__ import annotations

import pytest

from tests.support.services import RedisServer


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
async def redis_url(redis_server):
    """A clean database on the session's Redis server."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_server.url)
    await client.flushall()
    await client.aclose()
    return redis_server.url


from tests.support.sim import sim_factory, sim_factory_module  # noqa: E402,F401  (kvrouter sim fixtures)
