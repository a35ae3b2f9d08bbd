"""Live replay against real ``kvrouter sim`` engines (and the router in front of them) over
real sockets: records and usage, cached tokens on shared prefixes, the engines' own
prefix-cache counters, open-loop timing with --speed, bounded concurrency and duration,
errors recorded not raised, and the CLI's JSONL output."""

from __future__ import annotations

import json

import pytest

from loadtest import replay_cli
from loadtest.hitrate import ideal_infinite
from loadtest.live import LiveOptions, replay_live
from loadtest.traces.formats import write_mooncake
from loadtest.traces.generators import multi_turn
from loadtest.traces.types import TraceRequest
from router.config import Config
from router.server import Server

MODEL = "llama-3.1-8b"


def chat_trace() -> list[TraceRequest]:
    return multi_turn(n_sessions=6, turns=(2, 3), rate=40.0, think_time_s=(0.05, 0.2), system_blocks=(4, 8),
                      turn_blocks=(1, 4), output=(4, 12), block_size=16, seed=1)


@pytest.fixture(scope="module")
def sims(sim_factory_module):
    return sim_factory_module(2, time_scale=0, model=MODEL)


async def test_replay_against_one_engine_records_usage_and_cache_hits(sims):
    reqs = chat_trace()
    seen: list[dict] = []
    res = await replay_live(reqs, LiveOptions(target=sims[0].url + "/v1", speed=4.0,
                                              engine_metrics=(sims[0].url,)), seen.append)
    assert len(res.records) == len(reqs) == len(seen)
    for rec, tr in zip(res.records, reqs, strict=True):
        assert rec["status"] == 200 and rec["error"] is None, rec
        assert rec["prompt_tokens"] == tr.input_length  # byte tokenizer: text is block-exact
        assert rec["completion_tokens"] == tr.output_length
        assert rec["ttft_s"] is not None and rec["e2e_s"] >= rec["ttft_s"]
    s = res.summary
    assert s["ok"] == len(reqs) and not s["errors"] and s["model"] == MODEL
    # every follow-up turn re-reads its history from the cache
    assert s["hit_rate"] > 0.5 * ideal_infinite(reqs).token_rate > 0
    assert s["hit_rate"] <= ideal_infinite(reqs).token_rate + 1e-9
    # the engine's own counters tell the same story as usage
    assert s["engine_hit_rate"] == pytest.approx(s["hit_rate"], abs=0.02)


async def test_replay_through_router_names_replicas_and_follows_prefixes(sims):
    cfg = Config.from_dict({
        "listen": {"host": "127.0.0.1", "port": 0}, "policy": {"name": "cache_aware"},
        "replicas": [{"id": f"s{i}", "url": s.url, "models": [MODEL]} for i, s in enumerate(sims)],
        "scrape": {"interval_s": 0.2}, "logging": {"requests": False}, "auth": {"admin_key": "adm"}})
    server = await Server(cfg, seed=1).start()
    try:
        reqs = chat_trace()
        res = await replay_live(reqs, LiveOptions(target=server.url, speed=4.0, model=MODEL,
                                                  engine_metrics=("auto",), admin_key="adm"))
    finally:
        await server.stop()
    s = res.summary
    assert s["ok"] == len(reqs)
    assert {r["replica"] for r in res.records} <= {"s0", "s1"}
    assert sum(d["requests"] for d in s["per_replica"].values()) == len(reqs)
    assert s["hit_rate"] > 0.5 * ideal_infinite(reqs).token_rate
    # "auto" found both engines behind the router, and their counters agree with usage
    assert set(s["engine_prefix_cache"]) == {sims[0].url, sims[1].url}
    assert s["engine_hit_rate"] == pytest.approx(s["hit_rate"], abs=0.02)


async def test_open_loop_speed_concurrency_bound_and_duration(sim_factory):
    (slow,) = sim_factory(1, time_scale=1.0, model=MODEL)  # real-time engine: ~10 ms per step
    reqs = [TraceRequest(0.0, 64, 20, [i * 10 + j for j in range(4)], 16) for i in range(4)]
    res = await replay_live(reqs, LiveOptions(target=slow.url, max_concurrency=1))
    lates = [r["late_s"] for r in res.records]
    assert lates[0] < 0.5 and lates[-1] > lates[0]  # one at a time: each waits for the previous
    assert all(r["status"] == 200 for r in res.records)
    spread = [TraceRequest(t, 32, 2, [100 + k, 200 + k], 16) for k, t in enumerate((0.0, 0.4, 0.8, 4.0))]
    res = await replay_live(spread, LiveOptions(target=slow.url, speed=2.0, duration_s=1.0))
    assert [r["scheduled_s"] for r in res.records] == [0.0, 0.2, 0.4]  # 4.0 / 2 is past the duration
    assert res.summary["duration_s"] >= 0.4


async def test_errors_are_recorded_not_raised(sims):
    reqs = [TraceRequest(0.0, 32, 2, [1, 2], 16), TraceRequest(0.0, 32, 2, [1, 3], 16)]
    res = await replay_live(reqs, LiveOptions(target=sims[1].url, model="no-such-model"))
    assert all(r["status"] and r["status"] >= 400 and r["error"] for r in res.records)
    assert res.summary["ok"] == 0 and sum(res.summary["errors"].values()) == 2
    dead = await replay_live(reqs[:1], LiveOptions(target="http://127.0.0.1:9", model=MODEL, timeout_s=5))
    assert dead.records[0]["error"] and dead.records[0]["status"] is None


async def test_token_id_prompts_and_chat_endpoint(sims):
    reqs = [TraceRequest(0.0, 40, 3, [1, 2, 3], 16), TraceRequest(0.05, 40, 3, [1, 2, 4], 16)]
    tok = await replay_live(reqs, LiveOptions(target=sims[1].url, prompt_mode="tokens", model=MODEL))
    assert [r["prompt_tokens"] for r in tok.records] == [40, 40]
    assert tok.records[1]["cached_tokens"] == 32
    chat = await replay_live(reqs, LiveOptions(target=sims[1].url, endpoint="chat", model=MODEL))
    assert all(r["status"] == 200 and r["prompt_tokens"] > 40 for r in chat.records)
    assert chat.records[1]["cached_tokens"] >= 32


def test_replay_cli_writes_records_and_summary(sims, tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_mooncake(chat_trace()[:8], trace)
    out = tmp_path / "records.jsonl"
    rc = replay_cli.main([str(trace), "--block-size", "16", "--target", sims[0].url, "--speed", "8",
                          "--out", str(out), "--json", "--no-progress", "--engine-metrics", sims[0].url])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 8 == summary["requests"] == summary["ok"]
    assert sorted(r["i"] for r in lines) == list(range(8))
    assert "engine_hit_rate" in summary
    assert replay_cli.main([str(trace), "--target", "ftp://x"]) == 2
    # nothing listening: no model to ask for, a message and exit 1 (no traceback)
    assert replay_cli.main([str(trace), "--block-size", "16", "--target", "http://127.0.0.1:9"]) == 1
    assert "cannot use http://127.0.0.1:9" in capsys.readouterr().err


async def test_openai_body_trace_is_sent_as_recorded(sims, tmp_path):
    from loadtest.traces.formats import load_trace

    sys_msg = {"role": "system", "content": "You answer briefly. " * 8}
    rows = [{"timestamp": t, "body": {"model": MODEL, "messages": [sys_msg, {"role": "user", "content": q}],
                                      "max_tokens": 50}} for t, q in ((0.0, "first?"), (0.05, "second?"))]
    rows.append({"timestamp": 0.1, "body": {"model": MODEL, "prompt": "plain completion", "max_tokens": 3}})
    path = tmp_path / "bodies.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs = load_trace(path)
    res = await replay_live(reqs, LiveOptions(target=sims[1].url, max_output_tokens=4))
    assert [r["status"] for r in res.records] == [200, 200, 200]
    # the parser's byte-tokenizer length is what the engine counted (same chat template)
    assert [r["prompt_tokens"] for r in res.records] == [r.input_length for r in reqs]
    assert [r["completion_tokens"] for r in res.records] == [4, 4, 3]
    assert res.records[1]["cached_tokens"] >= 16 * (len(sys_msg["content"]) // 16)
