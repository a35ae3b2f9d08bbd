"""``make chaos`` in a short configuration: the real script, real processes (Redis, four sims,
two routers), every fault injected, and nothing may be lost or hung. Plus the script's pure
accounting (how a finished exchange is classified)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loadtest.chaos import Fault, Outcome, classify_stream, flat, summarize, verdict
from tests.support.services import ROOT

OK_STREAM = b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[],"usage":{"prompt_tokens":10,' \
            b'"prompt_tokens_details":{"cached_tokens":4}}}\n\ndata: [DONE]\n\n'


def test_classify():
    kind, _, usage = classify_stream(200, "text/event-stream", OK_STREAM)
    assert kind == "completed" and usage["prompt_tokens"] == 10
    err = b'data: {"choices":[{"text":"a"}]}\n\ndata: {"error":{"message":"m","type":"upstream_error",' \
          b'"param":null,"code":"upstream_error"}}\n\ndata: [DONE]\n\n'
    assert classify_stream(200, "text/event-stream", err)[0] == "failed"
    assert classify_stream(200, "text/event-stream", OK_STREAM[:40])[0] == "lost"  # truncated, no error
    assert classify_stream(200, "text/event-stream", b'data: {"choices":[]}\n\n')[0] == "lost"
    shaped = b'{"error":{"message":"m","type":"t","param":null,"code":"c"}}'
    assert classify_stream(503, "application/json", shaped)[0] == "failed"
    assert classify_stream(502, "text/plain", b"Bad Gateway")[0] == "lost"  # not OpenAI-shaped
    assert classify_stream(200, "application/json", b"{}")[0] == "lost"


def test_summary_windows_and_soak_check():
    outs = [Outcome(i, 0, t, t + 0.5, "completed", prompt_tokens=10, cached_tokens=c)
            for i, (t, c) in enumerate([(1, 9), (2, 9), (11, 1), (12, 1), (21, 8)])]
    outs.append(Outcome(9, 1, 11.5, 12.0, "failed", "stream error event"))
    s = summarize(outs, [Fault("f", 10.0, 20.0)])
    row = s["faults"][0]
    assert (row["sent"], row["failed"], row["lost"]) == (3, 1, 0)
    assert (row["hit_before"], row["hit_during"], row["hit_after"]) == (0.9, 0.1, 0.8)
    assert s["completed"] == 5 and s["failed"] == 1 and s["failed_outside_faults"] == 0
    late = Outcome(10, 0, 30.0, 31.5, "failed", "stream error event")
    assert summarize([*outs, late], [Fault("f", 10.0, 20.0)])["failed_outside_faults"] == 1
    assert flat([(t, 100, 50) for t in range(9)])[0]
    assert not flat([(t, 100 + 30 * t, 50) for t in range(9)])[0]
    assert not flat([(t, 100, 50 + 20 * t) for t in range(9)])[0]


def test_verdict_fails_on_a_failure_outside_the_fault_windows():
    outs = [Outcome(0, 0, 1.0, 1.5, "completed"), Outcome(1, 0, 11.0, 11.5, "failed", "stream error event")]
    faults = [Fault("f", 10.0, 20.0)]
    assert verdict(summarize(outs, faults)) == []  # failed inside the window: expected
    late = Outcome(2, 0, 30.0, 31.5, "failed", "stream error event")
    assert verdict(summarize([*outs, late], faults)) == ["1 request(s) failed outside the fault windows"]
    lost = Outcome(3, 1, 12.0, 12.1, "lost", "connection reset")
    assert verdict(summarize([*outs, lost], faults)) == ["1 lost request(s)"]
    s = {**summarize(outs, faults), "soak": {"ok": False, "detail": "RSS 10 -> 90 MiB"}}
    assert verdict(s) == [] and verdict(s, soak=True) == ["soak: resources grew (RSS 10 -> 90 MiB)"]


@pytest.mark.timeout(420)
def test_make_chaos_short_run_loses_nothing():
    cmd = [sys.executable, "-m", "loadtest.chaos", "--requests", "600", "--rate", "40", "--concurrency", "16",
           "--hold", "2", "--tail", "3", "--json", "--quiet"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert p.stdout, p.stderr[-3000:]
    s = json.loads(p.stdout)
    assert s["lost"] == 0 and s["hung"] == 0, json.dumps(s["details"])
    assert s["failed_outside_faults"] == 0, json.dumps(s["details"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert s["sent"] >= 600 and s["completed"] >= 0.9 * s["sent"]
    assert [f["fault"].split()[0] for f in s["faults"]] == ["kill", "kill", "SIGSTOP", "SIGTERM"]
    assert all(f["window_s"] > 0 for f in s["faults"])
