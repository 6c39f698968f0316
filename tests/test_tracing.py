"""One request is one trace: HTTP request span -> route, and -> specialist.generate -> queue,
prefill, decode (with speculation attributes and trigger events), continuing an incoming W3C
traceparent. Runs the router and a real specialist in-process (the same code path as under Serve,
where the trace context crosses the handle inside the request dict). Also: the exporters chosen
from OTEL_* variables, and the JSONL file exporter."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from router.backends import LocalBackend, local_specialists
from router.http import build_http_app
from router.routing import Router
from router.service import ChatService
from specialists.telemetry import (
    GenerationTimeline,
    JsonlSpanExporter,
    TelemetryConfigError,
    extract_context,
    inject_context,
    tracer_provider_from_env,
)
from specialists.train.tools import tools_for

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture(scope="module")
def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    specs = local_specialists(["shell"], "deploy/models", tracer_provider=provider)
    service = ChatService({"shell": LocalBackend(specs["shell"])}, Router(["shell"], None, "shell"), provider)
    with TestClient(build_http_app(service)) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        specs["shell"].engine.set_policy(specs["shell"].engine.gate.policy.merged({"mode": "on"}))
        yield client, exporter
    specs["shell"].shutdown()


def spans_of(exporter, trace_id: str) -> dict[str, object]:
    spans = [s for s in exporter.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id]
    by_name = {s.name: s for s in spans}
    assert len(by_name) == len(spans), [s.name for s in spans]
    return by_name


def assert_one_connected_trace(spans: dict, incoming_parent: str | None):
    post = spans["POST /v1/chat/completions"]
    gen = spans["specialist.generate"]
    assert (f"{post.parent.span_id:016x}" if post.parent else None) == incoming_parent
    assert spans["route"].parent.span_id == post.context.span_id
    assert gen.parent.span_id == post.context.span_id
    for name in ("queue", "prefill", "decode"):
        assert spans[name].parent.span_id == gen.context.span_id, name
    assert spans["queue"].end_time <= spans["prefill"].end_time <= spans["decode"].end_time
    assert post.start_time <= gen.start_time and gen.end_time <= post.end_time


def test_one_trace_from_http_request_to_decode(traced):
    client, exporter = traced
    exporter.clear()
    r = client.post("/v1/chat/completions", headers={"traceparent": TRACEPARENT},
                    json={"model": "shell", "messages": [{"role": "user", "content": "What is tar?"}], "max_tokens": 24})
    assert r.status_code == 200 and r.headers["x-trace-id"] == TRACE_ID
    spans = spans_of(exporter, TRACE_ID)
    assert {"POST /v1/chat/completions", "route", "specialist.generate", "queue", "prefill", "decode"} <= set(spans)
    assert_one_connected_trace(spans, PARENT_ID)
    route = spans["route"].attributes
    assert route["cantata.route.specialist"] == "shell" and route["cantata.route.reason"] == "pinned"
    decode = spans["decode"].attributes
    for key in ("drafted", "accepted", "mean_accepted_length", "rollbacks"):
        assert f"cantata.{key}" in decode, key
    assert decode["cantata.speculation"] == r.headers["x-speculation"] == "on"
    assert decode["cantata.drafted"] > 0 and 0 <= decode["cantata.accepted"] <= decode["cantata.drafted"]
    assert list(decode["cantata.ks"]) == r.json()["speculation_k"] and r.headers["x-speculation-k"] == ",".join(
        map(str, decode["cantata.ks"]))  # the K values the request verified, in the trace and the answer
    assert decode["cantata.completion_tokens"] == r.json()["usage"]["completion_tokens"]
    assert spans["prefill"].attributes["cantata.prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert spans["POST /v1/chat/completions"].attributes["http.response.status_code"] == 200


def test_streamed_tool_call_trace_has_trigger_events(traced):
    client, exporter = traced
    exporter.clear()
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "shell", "stream": True, "tools": tools_for("shell"), "tool_choice": "required",
            "messages": [{"role": "user", "content": "Show the man page of `tar`."}]}) as r:
        trace_id = r.headers["x-trace-id"]
        body = "".join(r.iter_lines())
    assert '"finish_reason": "tool_calls"' in body
    spans = spans_of(exporter, trace_id)
    assert_one_connected_trace(spans, None)  # no incoming traceparent: the request span is the root
    events = [e.name for e in spans["decode"].events]
    assert "tool_close" in events
    decode = spans["decode"]
    assert all(decode.start_time <= e.timestamp <= decode.end_time for e in decode.events)


def test_error_requests_are_traced_too(traced):
    client, exporter = traced
    exporter.clear()
    r = client.post("/v1/chat/completions", headers={"traceparent": TRACEPARENT},
                    json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404
    spans = spans_of(exporter, TRACE_ID)
    post = spans["POST /v1/chat/completions"]
    assert post.attributes["http.response.status_code"] == 404 and post.status.status_code.name == "ERROR"
    assert "specialist.generate" not in spans


def test_context_round_trip():
    provider = TracerProvider()
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("a") as span:
        carrier = inject_context()
    assert carrier["traceparent"].split("-")[1] == f"{span.get_span_context().trace_id:032x}"
    with tracer.start_as_current_span("b", context=extract_context(carrier)) as child:
        assert child.parent.span_id == span.get_span_context().span_id
    assert extract_context({}) is not None and extract_context(None) is not None


def _exporters(provider: TracerProvider) -> list:
    procs = provider._active_span_processor._span_processors  # noqa: SLF001 - inspecting the SDK's wiring
    return [getattr(p, "span_exporter", None) or getattr(getattr(p, "_batch_processor", None), "_exporter", None)
            for p in procs]


def test_exporters_follow_otel_env(tmp_path):
    path = tmp_path / "spans.jsonl"
    by_file = tracer_provider_from_env("router", {"CANTATA_TRACE_FILE": str(path)})
    assert [type(e) for e in _exporters(by_file)] == [JsonlSpanExporter]
    otlp = tracer_provider_from_env("router", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert [type(e) for e in _exporters(otlp)] == [OTLPSpanExporter]
    assert _exporters(tracer_provider_from_env("router", {"OTEL_TRACES_EXPORTER": "none"})) == []
    with pytest.raises(TelemetryConfigError):
        tracer_provider_from_env("router", {"OTEL_TRACES_EXPORTER": "zipkin-carrier-pigeon"})
    for p in (otlp,):
        p.shutdown()

    tracer = by_file.get_tracer("t")
    with tracer.start_as_current_span("outer"):
        with tracer.start_as_current_span("inner") as inner:
            inner.add_event("tool_open", {"cantata.output_index": 3})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [d["name"] for d in lines] == ["inner", "outer"]
    assert lines[0]["parent_span_id"] == lines[1]["span_id"] and lines[0]["trace_id"] == lines[1]["trace_id"]
    assert lines[0]["component"] == "router" and lines[0]["events"][0]["name"] == "tool_open"


def test_inter_token_gaps_count_each_token():
    t = GenerationTimeline(submitted_ns=0, token_marks=[(1_000_000_000, 1), (1_500_000_000, 2), (2_500_000_000, 4)])
    assert t.inter_token_s() == pytest.approx([0.5, 0.5, 0.5])
    assert t.time_of_token(0) == 1_000_000_000 and t.time_of_token(3) == 2_500_000_000 and t.time_of_token(9) is None
