"""``kvrouter plan`` end to end: the installed command run as a subprocess, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backends.plan_cli import build_parser

GiB, KiB = 1 << 30, 1 << 10


def kvrouter(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("kvrouter")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "router.cli"]
    return subprocess.run([*cmd, "plan", *args], capture_output=True, text=True, timeout=60)


def test_must_show_command_prints_the_pinned_figures():
    run = kvrouter("--model", "llama-3.1-8b", "--gpu", "a100-40gb", "--dtype", "fp16", "--context", "131072", "--json")
    assert run.returncode == 0, run.stderr
    d = json.loads(run.stdout)
    assert d["weights_bytes"] == 16_000_000_000
    assert d["kv_bytes_per_token"] == 128 * KiB
    assert d["kv_bytes_per_token_naive"] == 512 * KiB
    assert d["kv_bytes_per_sequence"] == 16 * GiB
    for key in ("overhead_bytes", "kv_capacity_tokens", "kv_capacity_blocks", "max_concurrent_sequences",
                "prefill_tokens_per_s", "decode_tokens_per_s_per_seq", "decode_tokens_per_s_total", "ttft_s",
                "request_latency_s", "max_concurrent_users", "fits", "verdict"):
        assert key in d, key
    assert d["kv_capacity_tokens"] == d["kv_capacity_blocks"] * 16
    assert (d["model"], d["gpu"], d["weight_dtype"], d["context"]) == ("llama-3.1-8b", "a100-40gb", "fp16", 131072)
    assert d["fits"] is True and d["max_concurrent_sequences"] == 1


def test_help_documents_every_option():
    run = kvrouter("--help")
    assert run.returncode == 0
    for action in build_parser()._actions:
        assert action.help, action.dest
        for opt in action.option_strings:
            assert opt in run.stdout, opt


def test_table_by_default_and_same_figures_as_json():
    run = kvrouter("--model", "qwen2.5-7b", "--gpu", "h100-80gb", "--batch-size", "16")
    assert run.returncode == 0, run.stderr
    for label in ("weights per GPU", "KV per token (GQA)", "KV per token (naive)", "KV capacity per replica",
                  "decode per sequence", "time to first token", "max concurrent users", "verdict"):
        assert label in run.stdout, label
    d = json.loads(kvrouter("--model", "qwen2.5-7b", "--gpu", "h100-80gb", "--batch-size", "16", "--json").stdout)
    assert f"{d['kv_capacity_tokens']:,} tokens = {d['kv_capacity_blocks']:,} blocks" in run.stdout


def test_does_not_fit_reports_a_verdict():
    d = json.loads(kvrouter("--model", "llama-3.1-70b", "--gpu", "a100-80gb", "--dtype", "fp16", "--json").stdout)
    assert d["fits"] is False
    assert "needs ≥ 2 GPUs at fp16 or int4" in d["verdict"]
    ok = json.loads(kvrouter("--model", "llama-3.1-70b", "--gpu", "a100-80gb", "--dtype", "fp16",
                             "--tp", "2", "--json").stdout)
    assert ok["fits"] is True and ok["num_gpus"] == 2 and ok["weights_bytes_per_gpu"] == 70_000_000_000


@pytest.mark.parametrize(
    ("args", "expected"),
    [(("--model", "gpt-9"), "llama-3.1-8b, llama-3.1-70b, llama-2-13b"),
     (("--gpu", "tpu"), "a100-40gb, a100-80gb, h100-80gb, h200, l4"),
     (("--dtype", "int3"), "fp32, fp16, bf16, fp8, int8, int4"),
     (("--kv-dtype", "int8"), "auto"),
     (("--tp", "3"), "attention heads"),
     (("--context", "lots"), "not a token count"),
     (("--bogus",), "unrecognized arguments")],
)
def test_bad_input_exits_2_with_a_clear_message(args, expected):
    run = kvrouter(*args)
    assert run.returncode == 2
    assert expected in run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""


def test_config_json_path_and_list(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
           "num_hidden_layers": 16, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
           "tie_word_embeddings": True, "max_position_embeddings": 131072}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    d = json.loads(kvrouter("--model", str(tmp_path), "--gpu", "l4", "--kv-dtype", "fp8", "--json").stdout)
    assert d["kv_bytes_per_token"] == 2 * 16 * 8 * 64 * 1
    assert d["model_spec"]["total_params"] == pytest.approx(1.236e9, rel=0.001)  # Llama 3.2 1B
    listing = kvrouter("--list")
    assert listing.returncode == 0 and "mixtral-8x7b" in listing.stdout and "h200" in listing.stdout
