"""Traces hold under hostile input (issue 14): attribute values are capped (OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT,
default 1024 characters), so a request with a 1 MB `model` writes kilobytes of spans, not megabytes;
and the JSONL trace file rotates by size, also with several processes writing it at once."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from router.backends import LocalBackend, local_specialists
from router.http import build_http_app
from router.routing import Router
from router.service import ChatService
from specialists.telemetry import (
    DEFAULT_ATTRIBUTE_VALUE_LENGTH,
    JsonlSpanExporter,
    TelemetryConfigError,
    tracer_provider_from_env,
)


def _file_exporter(provider: TracerProvider) -> JsonlSpanExporter:
    processors = provider._active_span_processor._span_processors  # noqa: SLF001 - the SDK has no public getter
    return next(p.span_exporter for p in processors if isinstance(p.span_exporter, JsonlSpanExporter))


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("limit", [None, 100])
def test_a_huge_model_name_writes_a_small_trace(tmp_path, limit):
    trace_file = tmp_path / "traces.jsonl"
    env = {"OTEL_TRACES_EXPORTER": "file", "CANTATA_TRACE_FILE": str(trace_file)}
    if limit is not None:
        env["OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT"] = str(limit)
    provider = tracer_provider_from_env("router", env)
    memory = InMemorySpanExporter()  # sees what the file does not hold: status descriptions (OTLP exports them)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    specs = local_specialists(["shell"], "deploy/models", tracer_provider=provider, warmup=False)
    service = ChatService({"shell": LocalBackend(specs["shell"])}, Router(["shell"], None, "shell"), provider)
    try:
        with TestClient(build_http_app(service)) as client:
            huge = "m" * 1_000_000
            r = client.post("/v1/chat/completions", json={"model": huge, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 404
            r = client.post("/v1/chat/completions", json={"model": "shell", "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "hi " * 20_000}]})
            assert r.status_code == 400
    finally:
        specs["shell"].shutdown()
    cap = limit or DEFAULT_ATTRIBUTE_VALUE_LENGTH
    spans = _lines(trace_file)
    assert {"POST /v1/chat/completions", "route"} <= {s["name"] for s in spans}
    values = [v for s in spans for v in s["attributes"].values()]
    values += [v for s in spans for e in s["events"] for v in e["attributes"].values()]
    assert max(len(v) for v in values if isinstance(v, str)) <= cap
    assert any(isinstance(v, str) and v == "m" * cap for v in values)  # the model was recorded, cut
    assert trace_file.stat().st_size < 40 * cap + 20_000, trace_file.stat().st_size
    assert max(len(s.status.description or "") for s in memory.get_finished_spans()) <= 1024


def test_limit_must_be_an_integer(tmp_path):
    with pytest.raises(TelemetryConfigError):
        tracer_provider_from_env("router", {"OTEL_TRACES_EXPORTER": "none", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "big"})


def _spans(provider: TracerProvider, n: int, tag: str) -> None:
    tracer = provider.get_tracer("t")
    for i in range(n):
        with tracer.start_as_current_span("s", attributes={"tag": tag, "i": i, "pad": "p" * 200}):
            pass


def test_trace_file_rotates_by_size(tmp_path):
    trace_file = tmp_path / "traces.jsonl"
    env = {"OTEL_TRACES_EXPORTER": "file", "CANTATA_TRACE_FILE": str(trace_file),
           "CANTATA_TRACE_FILE_MAX_BYTES": "20000", "CANTATA_TRACE_FILE_BACKUPS": "2"}
    provider = tracer_provider_from_env("router", env)
    exporter = _file_exporter(provider)
    assert (exporter.max_bytes, exporter.backups) == (20000, 2)
    _spans(provider, 400, "a")  # ~200 KB of spans through a 20 KB file with two backups
    files = [trace_file, tmp_path / "traces.jsonl.1", tmp_path / "traces.jsonl.2"]
    assert all(f.exists() and 0 < f.stat().st_size <= 20000 for f in files), [f.stat().st_size for f in files]
    assert not (tmp_path / "traces.jsonl.3").exists()
    kept = [s["attributes"]["i"] for f in reversed(files) for s in _lines(f)]
    assert kept == list(range(400 - len(kept), 400))  # the newest spans, in order, none torn


def test_defaults():
    exporter = JsonlSpanExporter(Path("/tmp/cantata-test-unused/traces.jsonl"))
    assert exporter.max_bytes == 64 * 1024 * 1024 and exporter.backups == 3


def _writer(path: str, tag: str, n: int) -> None:
    env = {"OTEL_TRACES_EXPORTER": "file", "CANTATA_TRACE_FILE": path, "CANTATA_TRACE_FILE_MAX_BYTES": "30000",
           "CANTATA_TRACE_FILE_BACKUPS": "200"}
    provider = tracer_provider_from_env(tag, env)
    _spans(provider, n, tag)
    provider.shutdown()


def test_processes_sharing_the_file_rotate_it_without_losing_or_tearing_lines(tmp_path):
    trace_file = tmp_path / "traces.jsonl"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(trace_file), tag, 300)) for tag in ("a", "b", "c")]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert time.monotonic() - t0 < 120
    files = sorted(tmp_path.glob("traces.jsonl*"))
    spans = [s for f in files if not f.name.endswith(".lock") for s in _lines(f)]
    assert len(files) > 5
    for tag in ("a", "b", "c"):
        assert sorted(s["attributes"]["i"] for s in spans if s["attributes"]["tag"] == tag) == list(range(300))
    assert all(f.stat().st_size <= 30000 for f in files)
