"""``replicas[].kv_events`` in the router config: validation naming the key, and the event
sources built from it (model = the replica's first, block size = that model's)."""

from __future__ import annotations

import pytest

from router.config import Config, ConfigError
from router.exact_index import ExactAwareIndex, attach_events, event_sources
from router.index.memory import MemoryIndex


def cfg(kv, **extra) -> Config:
    rep = {"id": "a", "url": "http://127.0.0.1:9001", "models": ["m1", "m2"], "kv_events": kv}
    return Config.from_dict({"models": {"m1": {"block_size": 32}}, "replicas": [
        rep, {"id": "b", "url": "http://127.0.0.1:9002", "models": ["m2"]}], **extra})


def test_sources_from_config():
    c = cfg({"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558", "topic": "t"})
    (src,) = event_sources(c)
    assert (src.replica, src.model, src.block_size, src.topic) == ("a", "m1", 32, "t")
    assert src.replay_endpoint == "tcp://127.0.0.1:5558" and not src.binds
    assert event_sources(cfg(None)) == []


def test_bind_rule():
    assert event_sources(cfg({"endpoint": "tcp://*:5557"}))[0].binds
    assert event_sources(cfg({"endpoint": "tcp://127.0.0.1:5557", "bind": True}))[0].binds
    assert not event_sources(cfg({"endpoint": "tcp://*:5557", "bind": False}))[0].binds


@pytest.mark.parametrize("kv, key", [
    ({"replay_endpoint": "tcp://x:1"}, "replicas[0].kv_events.endpoint"),
    ({"endpoint": "http://x:1"}, "replicas[0].kv_events.endpoint"),
    ({"endpoint": "tcp://x:1", "replay_endpoint": "x:2"}, "replicas[0].kv_events.replay_endpoint"),
    ({"endpoint": "tcp://x:1", "bogus": 1}, "replicas[0].kv_events.bogus"),
    ({"endpoint": "tcp://x:1", "bind": "yes"}, "replicas[0].kv_events.bind"),
    ("tcp://x:1", "replicas[0].kv_events"),
])
def test_errors_name_the_key(kv, key):
    with pytest.raises(ConfigError) as e:
        cfg(kv)
    assert key in str(e.value)


def test_attach_events_wraps_only_when_configured():
    idx = MemoryIndex()
    same, sub = attach_events(cfg(None), idx)
    assert same is idx and sub is None
    wrapped, sub = attach_events(cfg({"endpoint": "tcp://127.0.0.1:5557"}), idx)
    assert isinstance(wrapped, ExactAwareIndex) and wrapped.inner is idx and sub.replicas() == ["a"]


def test_shared_bound_endpoint_needs_distinct_topics():
    from router.events import EventSource, EventSubscriber

    ep = "tcp://127.0.0.1:5557"
    with pytest.raises(ValueError):
        EventSubscriber([EventSource("a", "m", 16, ep, bind=True), EventSource("b", "m", 16, ep, bind=True)],
                        MemoryIndex())
    EventSubscriber([EventSource("a", "m", 16, ep, topic="a", bind=True),
                     EventSource("b", "m", 16, ep, topic="b", bind=True)], MemoryIndex())
