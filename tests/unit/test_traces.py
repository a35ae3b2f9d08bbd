"""Trace parsers, the format sniffer, and `kvrouter trace` on real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import trace_cli
from loadtest.traces.formats import load_trace, parse_bailian, parse_mooncake, parse_openai, write_mooncake
from loadtest.traces.types import TraceFormatError

DATA = Path(__file__).resolve().parents[1] / "data"
EXCERPT = DATA / "mooncake_conversation_head300.jsonl"


def test_mooncake_parser_units_and_fields():
    lines = ['{"timestamp": 1500, "input_length": 1000, "output_length": 7, "hash_ids": [0, 1]}', "",
             '{"timestamp": 2000.5, "input_length": 512, "output_length": 3, "hash_ids": [0]}']
    a, b = parse_mooncake(lines)
    assert a.timestamp_s == 1.5 and b.timestamp_s == pytest.approx(2.0005)
    assert (a.input_length, a.output_length, a.hash_ids, a.block_size) == (1000, 7, [0, 1], 512)
    assert a.block_tokens(0) == 512 and a.block_tokens(1) == 488 and a.block_tokens(2) == 0
    assert parse_mooncake(lines[:1], block_size=16)[0].block_size == 16


@pytest.mark.parametrize("line, msg", [
    ("{not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    ('{"timestamp": 0, "input_length": -1, "hash_ids": []}', "input_length"),
    ('{"timestamp": 0, "input_length": 5, "hash_ids": [1, "x"]}', "hash_ids"),
    ('{"timestamp": "soon", "input_length": 5, "hash_ids": []}', "timestamp"),
])
def test_mooncake_parser_rejects_bad_lines_naming_the_line(line, msg):
    with pytest.raises(TraceFormatError, match=msg) as ei:
        parse_mooncake(['{"timestamp": 0, "input_length": 1, "hash_ids": [0]}', line], source="t.jsonl")
    assert "t.jsonl:2" in str(ei.value)


def test_bailian_parser_sessions_follow_parent_links():
    rows = [
        {"chat_id": 10, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 40, "output_length": 5,
         "type": "text", "turn": 1, "hash_ids": [1, 2, 3]},
        {"chat_id": 11, "parent_chat_id": -1, "timestamp": 0.7, "input_length": 20, "output_length": 5,
         "hash_ids": [7, 8]},
        {"chat_id": 12, "parent_chat_id": 10, "timestamp": 3.0, "input_length": 70, "output_length": 9,
         "hash_ids": [1, 2, 3, 4, 5]},
        {"chat_id": 13, "parent_chat_id": 12, "timestamp": 9.0, "input_length": 90, "output_length": 9,
         "hash_ids": [1, 2, 3, 4, 5, 6]},
    ]
    reqs = parse_bailian([json.dumps(r) for r in rows])
    assert [r.session_id for r in reqs] == ["10", "11", "10", "10"]
    assert reqs[0].timestamp_s == 0.5 and reqs[0].block_size == 16
    assert reqs[3].hash_ids[:5] == reqs[2].hash_ids


def test_openai_parser_chat_and_completions_share_prefix_hashes():
    sys_msg = {"role": "system", "content": "You are a helpful assistant. " * 4}
    rows = [
        {"timestamp": 0.0, "body": {"model": "m", "messages": [sys_msg, {"role": "user", "content": "hi"}],
                                    "max_tokens": 12}},
        {"timestamp": 1.25, "endpoint": "/v1/chat/completions",
         "body": {"model": "m", "messages": [sys_msg, {"role": "user", "content": "other question"}]}},
        {"timestamp": 2, "model": "m", "prompt": "abcdefghijklmnopqrstuvwxyz", "max_tokens": 3},
    ]
    a, b, c = parse_openai([json.dumps(r) for r in rows], block_size=16)
    assert a.endpoint == b.endpoint == "chat" and c.endpoint == "completions"
    assert a.output_length == 12 and c.output_length == 3 and c.input_length == 26
    shared = len(sys_msg["content"]) // 16  # the system message spans at least this many blocks
    assert a.hash_ids[:shared] == b.hash_ids[:shared]
    assert a.hash_ids[-1] != b.hash_ids[-1]
    assert len(c.hash_ids) == 2  # one full block and the named partial tail
    assert c.body == {"model": "m", "prompt": "abcdefghijklmnopqrstuvwxyz", "max_tokens": 3}
    with pytest.raises(TraceFormatError, match="messages"):
        parse_openai([json.dumps({"timestamp": 0, "body": {"messages": "hi"}})])


def test_load_trace_sniffs_each_format(tmp_path):
    reqs = load_trace(EXCERPT)
    assert len(reqs) == 300
    assert reqs[0].hash_ids[0] == 0 and reqs[0].input_length == 6758 and reqs[0].block_size == 512
    assert all(r.hash_ids[0] == 0 for r in reqs)  # every request starts with the system prompt
    assert len(load_trace(EXCERPT, limit=10)) == 10
    p = tmp_path / "b.jsonl"
    p.write_text(json.dumps({"chat_id": 1, "parent_chat_id": -1, "timestamp": 0, "input_length": 3,
                             "output_length": 1, "hash_ids": [5]}) + "\n")
    assert load_trace(p)[0].session_id == "1"
    p.write_text(json.dumps({"timestamp": 0, "body": {"prompt": "x"}}) + "\n")
    assert load_trace(p)[0].body == {"prompt": "x"}
    p.write_text('{"foo": 1}\n')
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        load_trace(p)


def test_write_mooncake_round_trip(tmp_path):
    reqs = load_trace(EXCERPT, limit=50)
    out = tmp_path / "t.jsonl"
    assert write_mooncake(reqs, out) == 50
    back = load_trace(out)
    assert [(r.timestamp_s, r.input_length, r.output_length, r.hash_ids) for r in back] == \
        [(r.timestamp_s, r.input_length, r.output_length, r.hash_ids) for r in reqs]


def test_trace_stats_cli_json(capsys):
    assert trace_cli.main(["stats", str(EXCERPT), "--json", "--capacity-blocks", "0,1000000"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["requests"] == 300 and st["block_size"] == 512
    assert st["blocks"] == sum(len(r.hash_ids) for r in load_trace(EXCERPT))
    pooled = {p["capacity_blocks"]: p["hit_rate"] for p in st["ideal_pooled"]}
    assert pooled[0] == 0.0
    assert pooled[1000000] == pytest.approx(st["ideal_infinite_hit_rate"])
    assert 0 < st["ideal_infinite_hit_rate"] < 1
    assert st["input_length"]["max"] >= st["input_length"]["p99"] >= st["input_length"]["p50"]


def test_trace_cli_text_errors_and_generate(tmp_path, capsys):
    assert trace_cli.main(["stats", str(EXCERPT), "--limit", "20"]) == 0
    assert "requests        20" in capsys.readouterr().out
    assert trace_cli.main(["stats", str(tmp_path / "missing.jsonl")]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    assert trace_cli.main(["stats", str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    out = tmp_path / "gen.jsonl"
    assert trace_cli.main(["generate", "tenants", "--out", str(out), "--seed", "4",
                           "--param", "n_requests=25", "--param", "user_blocks=[1,2]"]) == 0
    reqs = load_trace(out, block_size=16)
    assert len(reqs) == 25 and all(len(r.hash_ids) >= 1 for r in reqs)
    assert trace_cli.main(["generate", "tenants", "--out", str(out), "--param", "bogus=1"]) == 2
