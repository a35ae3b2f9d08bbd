"""The pool's pure parts: the health state machine, the in-flight guard, membership and
the cached per-model snapshot."""

from __future__ import annotations

import pytest

from backends.engines import EngineLoad
from router.config import HealthConfig, ReplicaConfig, ScrapeConfig
from router.pool import Guard, HealthTracker, Pool


@pytest.mark.parametrize("fail_t, ok_t, seq, want", [
    (2, 1, [False], [True]),
    (2, 1, [False, False], [True, False]),
    (2, 1, [False, True, False], [True, True, True]),  # not consecutive: stays in
    (1, 3, [False, True, True], [False, False, False]),  # needs 3 successes to return
    (1, 3, [False, True, True, True], [False, False, False, True]),
    (1, 2, [False, True, False, True, True], [False, False, False, False, True]),
])
def test_health_tracker(fail_t, ok_t, seq, want):
    t = HealthTracker(fail_t, ok_t)
    got = []
    for ok in seq:
        t.observe(ok)
        got.append(t.healthy)
    assert got == want


def test_force_eject_ignores_threshold():
    t = HealthTracker(5, 1)
    assert t.observe(False, force_eject=True) and not t.healthy


def _pool(removed=None):
    reps = [ReplicaConfig(id="a", url="http://h:1", models=("m", "n")),
            ReplicaConfig(id="b", url="http://h:2", models=("m",))]
    return Pool(reps, HealthConfig(failure_threshold=1), ScrapeConfig(),
                on_removed=(removed.append if removed is not None else None))


def test_guard_releases_once():
    p = _pool()
    st = p.get("a").state
    g = p.acquire("a")
    with p.acquire("a"):
        assert st.in_flight == 2
    g.release()
    g.release()
    assert st.in_flight == 0
    with pytest.raises(RuntimeError), Guard(st):
        raise RuntimeError("the request failed")
    assert st.in_flight == 0


def test_snapshot_is_cached_and_follows_membership():
    removed: list[str] = []
    p = _pool(removed)
    snap = p.snapshot("m")
    assert [s.id for s in snap] == ["a", "b"] and p.snapshot("m") is snap  # no per-request rebuild
    assert [s.id for s in p.snapshot("n")] == ["a"] and p.snapshot("x") == []
    p.add(ReplicaConfig(id="c", url="http://h:3", models=("n",)))
    assert [s.id for s in p.snapshot("n")] == ["a", "c"]
    with pytest.raises(ValueError):
        p.add(ReplicaConfig(id="c", url="http://h:4", models=("n",)))
    assert p.remove("a") and removed == ["a"] and not p.remove("a")
    assert [s.id for s in p.snapshot("m")] == ["b"]


def test_connect_error_ejects_and_drops_index_entries():
    removed: list[str] = []
    p = _pool(removed)
    p.report_connect_error("b", "refused")
    assert not p.get("b").state.healthy and removed == ["b"] and p.get("b").ejections == 1
    assert p.healthy_models() == ["m", "n"]  # a still serves both


def test_apply_load_updates_state_in_place():
    p = _pool()
    rep = p.get("a")
    p.apply_load(rep, EngineLoad(engine="vllm", running=3, waiting=2, kv_usage=0.5, num_blocks=1000))
    st = p.snapshot("m")[0]
    assert (st.running, st.waiting, st.kv_usage, st.capacity_blocks, st.load) == (3, 2, 0.5, 1000, 5)
