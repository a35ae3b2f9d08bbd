"""The redis-py cluster client behind ``RedisClusterIndex.remove``/``clear`` gets the URL's TLS
and credentials: a ``rediss://`` cluster never falls back to plain TCP (no server needed: the
client is only constructed, nothing is sent)."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import SSLConnection

from router.index.cluster import RedisClusterIndex, cluster_client_kwargs


def test_rediss_url_gives_tls_and_decoded_credentials() -> None:
    kw = cluster_client_kwargs("rediss://ops:p%40ss%3Aw0rd@n1.example:7000,n2.example:7001/0", 0.25)
    assert kw["ssl"] is True
    assert (kw["username"], kw["password"]) == ("ops", "p@ss:w0rd")
    assert kw["startup_nodes"] == [("n1.example", 7000), ("n2.example", 7001)]
    assert kw["socket_timeout"] == kw["socket_connect_timeout"] == 1.0


def test_plain_url_without_user() -> None:
    kw = cluster_client_kwargs("redis://:pw@127.0.0.1:7000", 2.0)
    assert kw["ssl"] is False and kw["username"] is None and kw["password"] == "pw"
    assert kw["socket_timeout"] == 2.0
    kw = cluster_client_kwargs("redis://127.0.0.1:7000", 0.25)
    assert kw["username"] is None and kw["password"] is None


def test_bad_scheme_is_refused() -> None:
    with pytest.raises(ValueError, match="scheme"):
        cluster_client_kwargs("http://127.0.0.1:7000", 0.25)


def test_the_index_builds_its_cluster_client_with_tls() -> None:
    idx = RedisClusterIndex("rediss://ops:secret@127.0.0.1:7000,127.0.0.1:7001")
    ckw = idx.client.connection_kwargs
    assert ckw["connection_class"] is SSLConnection
    assert ckw["password"] == "secret" and ckw["username"] == "ops"
    plain = RedisClusterIndex("redis://127.0.0.1:7000")
    assert plain.client.connection_kwargs.get("connection_class") is not SSLConnection
