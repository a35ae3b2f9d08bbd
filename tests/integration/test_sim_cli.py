"""`kvrouter sim` as a command: --help documents every option, bad options fail cleanly,
--time-scale stretches wall time by the factor, --tokenizer uses a local tokenizer.json,
and the test helper restarts a killed sim on the same port."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from backends.engines import parse_samples
from backends.sim.cli import build_parser, build_server
from tests.support.services import ROOT

FLAGS = ["--host", "--port", "--model", "--model-config", "--gpu", "--dtype", "--kv-dtype", "--num-blocks",
         "--block-size", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--no-prefix-caching",
         "--spec-tokens", "--spec-acceptance", "--time-scale", "--seed", "--tokenizer"]


def test_help_documents_every_option():
    out = subprocess.run([sys.executable, "-m", "router.cli", "sim", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0
    for flag in FLAGS:
        assert flag in out.stdout, flag
    for action in build_parser()._actions:
        assert action.help, action.option_strings


@pytest.mark.parametrize("argv,needle", [
    (["--model", "llama-3.1-70b", "--gpu", "l4"], "does not fit"),
    (["--gpu", "tpu"], "unknown GPU"),
    (["--spec-acceptance", "1.5"], "spec-acceptance"),
    (["--num-blocks", "10", "--max-model-len", "4096"], "max-model-len"),
])
def test_bad_options_exit_with_a_message(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        build_server(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_planner_sets_capacity_and_options_override():
    server, _ = build_server(["--model", "llama-3.1-8b", "--gpu", "a100-40gb"])
    base = server.engine.config.num_blocks
    assert base > 1000 and server.engine.config.max_model_len <= base * 16
    int4, _ = build_server(["--model", "llama-3.1-8b", "--gpu", "a100-40gb", "--dtype", "int4"])
    assert int4.engine.config.num_blocks > base  # smaller weights leave more room for KV
    small, _ = build_server(["--num-blocks", "100", "--max-model-len", "1000", "--no-prefix-caching"])
    cfg = small.engine.config
    assert (cfg.num_blocks, cfg.max_model_len, cfg.enable_prefix_caching) == (100, 1000, False)


def _e2e_sum(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(v for n, _, v in parse_samples(text, ("vllm:e2e_request_latency_seconds_sum",)))


def test_time_scale_stretches_wall_time(sim_factory):
    scaled, instant = sim_factory(1, time_scale=0.5)[0], sim_factory(1, time_scale=0)[0]
    body = {"model": "llama-3.1-8b", "prompt": "time me", "max_tokens": 80}
    walls = {}
    for sim in (scaled, instant):
        httpx.get(sim.url + "/health")
        t0 = time.perf_counter()
        assert httpx.post(sim.url + "/v1/completions", json=body, timeout=60).status_code == 200
        walls[sim.url] = time.perf_counter() - t0
    sim_s = _e2e_sum(scaled.url)
    assert sim_s == pytest.approx(_e2e_sum(instant.url), rel=0.05)  # same simulated work
    assert 0.5 < sim_s < 2.0  # 80 decode steps of ~10 ms on an A100
    assert walls[scaled.url] >= 0.9 * 0.5 * sim_s  # sleeps cannot be shorter than asked
    assert walls[scaled.url] < 0.5 * sim_s + 3.0
    assert walls[instant.url] < 0.5 * sim_s  # time scale 0: no simulated waiting


def test_local_tokenizer_json(sim_factory, tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["hello world the quick brown fox jumps over the lazy dog"] * 50, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    (sim,) = sim_factory(1, tokenizer=str(path))
    got = httpx.post(sim.url + "/tokenize", json={"prompt": "hello world"}).json()
    assert got["tokens"] == tok.encode("hello world").ids and got["count"] < len("hello world")
    r = httpx.post(sim.url + "/v1/completions", json={"prompt": "hello world", "max_tokens": 20}).json()
    assert r["usage"]["prompt_tokens"] == got["count"]
    text = r["choices"][0]["text"]
    assert text and text.replace(" ", "").isalpha() and text.isascii()


def test_kill_and_restart_on_the_same_port(sim_factory):
    (sim,) = sim_factory(1)
    port = sim.port
    sim.kill()
    assert not sim.alive()
    with pytest.raises(httpx.HTTPError):
        httpx.get(sim.url + "/health", timeout=2)
    sim.restart()
    assert sim.port == port and httpx.get(sim.url + "/health").status_code == 200
