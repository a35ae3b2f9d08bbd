"""Generated Mooncake traces record their block size and readers use it; a trace read with
a block size that does not match its hash ids and input lengths warns once on stderr."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest import trace_cli
from loadtest.traces.formats import length_mismatch, load_trace, parse_mooncake

EXCERPT = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head300.jsonl"


def test_generated_trace_records_its_block_size_and_stats_use_it(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert trace_cli.main(["generate", "multi_turn", "--out", str(out), "--seed", "1"]) == 0
    first = json.loads(out.read_text().splitlines()[0])
    assert first["block_size"] == 16 and set(first) >= {"timestamp", "input_length", "output_length", "hash_ids"}
    capsys.readouterr()
    assert trace_cli.main(["stats", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["block_size"] == 16
    assert "warning" not in captured.err
    reqs = load_trace(out)
    assert {r.block_size for r in reqs} == {16}


def test_wrong_block_size_warns_once(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert trace_cli.main(["generate", "multi_turn", "--out", str(out), "--seed", "1"]) == 0
    capsys.readouterr()
    warnings: list[str] = []
    reqs = load_trace(out, block_size=512, warn=warnings.append)  # an explicit, wrong, override
    assert {r.block_size for r in reqs} == {512}
    assert len(warnings) == 1 and "block size" in warnings[0]
    load_trace(out, block_size=512)  # default: one line on stderr
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "--block-size" in err
    # the same lines without the field are read at Mooncake's 512, and warn too
    stripped = tmp_path / "s.jsonl"
    stripped.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "block_size"}) + "\n"
                                for line in out.read_text().splitlines()))
    warnings.clear()
    assert {r.block_size for r in load_trace(stripped, warn=warnings.append)} == {512}
    assert len(warnings) == 1


def test_real_mooncake_excerpt_reads_at_512_without_warnings():
    warnings: list[str] = []
    reqs = load_trace(EXCERPT, warn=warnings.append)
    assert len(reqs) == 300 and {r.block_size for r in reqs} == {512}
    assert warnings == []


def test_length_mismatch_thresholds():
    assert not length_mismatch(6758, 14, 512)  # exact: 13 full blocks and a partial one
    assert not length_mismatch(1, 1, 512)
    assert length_mismatch(14 * 16, 14, 512)  # a 16-token trace read at 512
    assert length_mismatch(14 * 512, 14, 16)  # a 512-token trace read at 16
    assert length_mismatch(100, 0, 16)  # tokens but no hash ids
    assert parse_mooncake(['{"timestamp": 0, "input_length": 20, "hash_ids": [1, 2], "block_size": 16}'
                           ])[0].block_size == 16
