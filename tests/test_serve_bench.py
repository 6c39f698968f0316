"""`python -m bench.serving` against a real `serve run deploy/ensemble.yaml`: 24 mixed requests at
concurrency 8 with --check-determinism give no failures, identical greedy outputs, figures that add
up, and one JSONL row. The server is started as the README starts it, by tests/serve_harness.py
(one `serve run` for this module, stopped at its end)."""

from __future__ import annotations

import json

import pytest

from bench.common import git_commit
from bench.serving import main
import serve_harness
from serve_harness import BASE

pytestmark = pytest.mark.slow

N, C, MAX_TOKENS = 24, 8, 32
DOMAINS = ("cpp", "python", "build", "shell")
SPECIALISTS = (*DOMAINS, "general")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> serve_harness.Server:
    with serve_harness.running_server(tmp_path_factory.mktemp("serve-bench"), "bench-admin-token") as running:
        yield running


def test_bench_serving_against_serve_run(server, tmp_path, capsys):
    out = tmp_path / "serving.jsonl"
    rc = main(["--url", BASE, "--num-requests", str(N), "--concurrency", str(C), "--max-tokens", str(MAX_TOKENS),
               "--seed", "0", "--check-determinism", "--wait-ready", "30", "--timeout", "120", "--out", str(out)])
    printed = capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    f, det = row["figures"], row["determinism"]
    assert rc == 0, printed
    assert (f["requests"], f["ok"], f["failed"], f["failures"]) == (N, N, 0, {}), row["failure_examples"]
    assert f["http_status"] == {"200": N}
    # the mix has every kind of request (seed 0), and every request is counted once everywhere
    mix = f["mix"]
    assert min(mix.values()) > 0 and mix["stream"] < N
    assert sum(f["per_specialist"].values()) == N and set(f["per_specialist"]) <= set(SPECIALISTS)
    assert sum(f["x_speculation"].values()) == N and set(f["x_speculation"]) <= {"on", "off", "fallback"}
    assert sum(f["speculation_used"].values()) == N and sum(f["finish_reasons"].values()) == N
    assert f["latency_s"]["n"] == N and f["ttft_s"]["n"] == mix["stream"]
    assert f["latency_stream_s"]["n"] == mix["stream"] and f["latency_nonstream_s"]["n"] == N - mix["stream"]
    assert 0 < f["ttft_s"]["p50"] <= f["ttft_s"]["p90"] <= f["ttft_s"]["p99"] <= f["latency_s"]["max"]
    assert f["missing_usage"] == 0 and N <= f["output_tokens"] <= N * MAX_TOKENS
    assert f["output_tokens_per_s"] == pytest.approx(f["output_tokens"] / f["wall_s"])
    assert f["auto_ok"] == mix["auto"] and f["tool_requests_ok"] == mix["tool"] and f["tool_requests_calling"] > 0
    # greedy outputs: alone == under load
    assert det["total"] > 0 and det["identical"] == det["total"] and det["mismatches"] == [] and det["alone_failed"] == 0
    assert row["commit"] == git_commit() and row["url"] == BASE and set(row["models"]) == {"auto", *SPECIALISTS}
    assert row["params"]["num_requests"] == N and row["params"]["concurrency"] == C
    assert row["machine"]["cpu_count"] >= 1 and len(row["machine"]["loadavg"]) == 3
    assert f"{N} ok / 0 failed of {N}" in printed and f"{det['total']}/{det['total']} greedy outputs identical" in printed

