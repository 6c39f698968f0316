"""bench.serving without a Cantata server: the request mix, the percentiles and aggregation on
synthetic outcomes, the determinism comparison, and the HTTP client's classification of failures
against a small aiohttp server that answers with canned SSE streams (a good one, an SSE error event,
a stream cut before [DONE], a 503)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from bench.serving import main
from bench.serving_client import Outcome, send
from bench.serving_mix import MixOptions, RequestSpec, build_mix, determinism_sample, load_pools
from bench.serving_report import compare_determinism, format_table, percentile, summarize

DATA = Path(__file__).resolve().parents[1] / "bench" / "data"


def test_percentile_matches_numpy_linear():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 100, 101):
        xs = rng.exponential(size=n).tolist()
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def _spec(i: int, *, model: str = "cpp", domain: str = "cpp", stream: bool = False, tool: bool = False,
          sampled: bool = False) -> RequestSpec:
    return RequestSpec(i, domain, model, stream, tool, sampled, body={})


def test_summarize_counts_failures_throughput_and_percentiles():
    specs = [_spec(i, stream=i % 2 == 0, model="auto" if i < 4 else "cpp", domain="shell" if i < 2 else "cpp",
                   tool=i == 9) for i in range(10)]
    outcomes = [Outcome(i, stream=i % 2 == 0, status=200, latency_s=0.1 * (i + 1), ttft_s=0.01 * (i + 1) if i % 2 == 0 else None,
                        completion_tokens=10, specialist="shell" if i == 0 else "cpp", speculation_header="on",
                        speculation_used="fallback" if i == 2 else "on", finish_reason="length") for i in range(7)]
    outcomes[6].tool_calls = []
    outcomes += [Outcome(7, stream=False, failure="http_503", status=503, latency_s=0.05),
                 Outcome(8, stream=True, failure="cut_stream", status=200, latency_s=2.0, completion_tokens=5),
                 Outcome(9, stream=False, failure="timeout", latency_s=9.0)]
    f = summarize(specs, list(reversed(outcomes)), wall_s=2.0)
    assert (f["requests"], f["ok"], f["failed"]) == (10, 7, 3)
    assert f["failures"] == {"http_503": 1, "cut_stream": 1, "timeout": 1}
    assert f["http_status"] == {"200": 8, "503": 1}
    assert f["output_tokens"] == 70 and f["output_tokens_per_s"] == 35.0 and f["requests_per_s"] == 3.5
    ok_latencies = [0.1 * (i + 1) for i in range(7)]
    assert f["latency_s"]["n"] == 7 and f["latency_s"]["p50"] == pytest.approx(np.percentile(ok_latencies, 50))
    assert f["latency_s"]["p99"] == pytest.approx(np.percentile(ok_latencies, 99))
    assert f["ttft_s"]["n"] == 4 and f["ttft_s"]["p90"] == pytest.approx(np.percentile([0.01, 0.03, 0.05, 0.07], 90))
    assert f["latency_stream_s"]["n"] + f["latency_nonstream_s"]["n"] == 7
    assert f["per_specialist"] == {"cpp": 6, "shell": 1}
    assert f["x_speculation"] == {"on": 7} and f["speculation_used"] == {"fallback": 1, "on": 6}
    assert (f["auto_ok"], f["auto_routed_to_prompt_domain"]) == (4, 3)  # #0 shell->shell, #1 shell->cpp, #2,#3 cpp
    assert f["mix"] == {"stream": 5, "tool": 1, "sampled": 0, "auto": 4}
    table = format_table(f, {"total": 2, "identical": 1, "mismatches": [
        {"index": 3, "model": "cpp", "stream": False, "alone": "[length] 'a'", "under_load": "[length] 'b'"}]})
    assert "7 ok / 3 failed of 10" in table and "1/2 greedy outputs identical" in table and "mismatch #3" in table


def test_compare_determinism():
    sample = [_spec(i) for i in range(4)]
    alone = {i: Outcome(i, False, text=f"t{i}", finish_reason="stop") for i in range(4)}
    loaded = {0: Outcome(0, False, text="t0", finish_reason="stop"), 1: Outcome(1, False, text="other", finish_reason="stop"),
              2: Outcome(2, False, text="t2", finish_reason="length"), 3: Outcome(3, False, failure="http_500")}
    d = compare_determinism(sample, alone, loaded)
    assert (d["total"], d["identical"]) == (4, 1)
    assert [m["index"] for m in d["mismatches"]] == [1, 2, 3] and "failed: http_500" in d["mismatches"][2]["under_load"]


def test_mix_is_reproducible_and_follows_the_fractions():
    pools = load_pools(DATA)
    opts = MixOptions(num_requests=400, stream_fraction=0.5, tool_fraction=0.25, sampling_fraction=0.2, seed=1)
    a, b = build_mix(pools, opts), build_mix(pools, opts)
    assert [s.body for s in a] == [s.body for s in b]
    assert 150 < sum(s.stream for s in a) < 250 and 60 < sum(s.tool for s in a) < 140
    assert {s.domain for s in a} == {"cpp", "python", "build", "shell"} and any(s.model == "auto" for s in a)
    for s in a:
        assert s.body["max_tokens"] == 64 and s.body.get("stream", False) == s.stream
        assert ("tools" in s.body) == s.tool and (s.model in ("auto", s.domain))
        assert (s.body["temperature"] > 0) == s.sampled and ("seed" in s.body) == s.sampled
    choices = {c if isinstance(c, str) else "named" for c in (s.body["tool_choice"] for s in a if s.tool)}
    assert choices == {"auto", "required", "named"}
    sample = determinism_sample(a, 10)
    assert len(sample) == 10 and all(not s.tool and not s.sampled for s in sample)


async def _canned(request: web.Request) -> web.StreamResponse:
    kind = request.headers.get("x-kind") or (await request.json())["messages"][0]["content"]
    if kind == "503":
        return web.json_response({"error": {"message": "warming up", "type": "service_unavailable"}}, status=503)
    resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-cantata-specialist": "cpp", "x-speculation": "on"})
    await resp.prepare(request)
    chunk = {"choices": [{"index": 0, "delta": {"content": "hel"}, "finish_reason": None}]}
    await resp.write(b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n')
    await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await resp.write(b'data: {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}], "speculation": "fallback"}\n\n')
    if kind == "error":
        await resp.write(b'data: {"error": {"message": "replica died", "type": "service_unavailable"}}\n\n')
    elif kind == "ok":
        await resp.write(b'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\ndata: [DONE]\n\n')
    await resp.write_eof()
    return resp


async def _send_all(kinds: list[str]) -> list[Outcome]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _canned)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            specs = [RequestSpec(i, "cpp", "cpp", True, False, False, {"messages": [{"content": k}]}) for i, k in enumerate(kinds)]
            return [await send(session, f"http://127.0.0.1:{port}", s) for s in specs]
    finally:
        await runner.cleanup()


def test_client_classifies_streams():
    ok, err, cut, busy = asyncio.run(_send_all(["ok", "error", "cut", "503"]))
    assert ok.ok and ok.text == "hello" and ok.completion_tokens == 2 and ok.finish_reason == "stop"
    assert ok.specialist == "cpp" and ok.speculation_header == "on" and ok.speculation_used == "fallback"
    assert ok.ttft_s is not None and 0 < ok.ttft_s <= ok.latency_s
    assert err.failure == "sse_error:service_unavailable" and err.error_message == "replica died"
    assert cut.failure == "cut_stream" and cut.text == "hello"
    assert busy.failure == "http_503" and busy.status == 503 and busy.error_message == "warming up"


def test_a_server_that_is_not_up_is_a_clear_error(caplog):
    """A port nobody listens on: exit status 2 and a message naming the URL, after --wait-ready."""
    rc = main(["--url", "http://127.0.0.1:9", "--num-requests", "1", "--wait-ready", "1", "--no-record"])
    assert rc == 2
    assert "http://127.0.0.1:9 is not ready after 1 s" in caplog.text and "serve run" in caplog.text
