"""OpenTelemetry for the router and the specialists (no Ray in here).

* `tracer_provider_from_env(component)`: exporters from the standard OTEL_* variables.
  OTEL_TRACES_EXPORTER (comma list of otlp | console | file | none) wins; when it is unset, OTLP over
  HTTP is used if OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set, else
  one JSON line per span is appended to CANTATA_TRACE_FILE (default `<tmp>/cantata/traces.jsonl`),
  rotated by size (CANTATA_TRACE_FILE_MAX_BYTES, default 64 MiB; CANTATA_TRACE_FILE_BACKUPS, default 3).
  Attribute values are capped at OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT characters (default 1024).
  The sampler comes from OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (the SDK reads them).
  Providers are built by the objects that use them (in __init__), never at import.
* `inject_context` / `extract_context`: W3C trace context in a plain dict, carried in the request
  that goes from the router to a specialist, so one request is one trace.
* `record_generation_spans`: the queue, prefill and decode spans of one generation, built after the
  fact from wall-clock marks and the engine's per-request statistics, with trigger events.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

TRACER_NAME = "cantata"


DEFAULT_ATTRIBUTE_VALUE_LENGTH = 1024  # characters, when OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT is unset
DEFAULT_TRACE_FILE_MAX_BYTES = 64 * 1024 * 1024  # CANTATA_TRACE_FILE_MAX_BYTES
DEFAULT_TRACE_FILE_BACKUPS = 3  # CANTATA_TRACE_FILE_BACKUPS


class TelemetryConfigError(ValueError):
    """OTEL_TRACES_EXPORTER names an exporter this build does not have."""


# ---- exporters -----------------------------------------------------------------------------------


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
                   for e in span.events],
        "service": (span.resource.attributes or {}).get("service.name") if span.resource else None,
        "component": (span.resource.attributes or {}).get("cantata.component") if span.resource else None,
    }


class JsonlSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file, rotating it by size: when a write would
    take the file past `max_bytes`, it becomes `<file>.1` (`.1` becomes `.2`, ... up to `backups`;
    the oldest is dropped). Several processes (router, specialists) share the file: each write is one
    O_APPEND write, and the size check, rotation and write happen under an flock on `<file>.lock`."""

    def __init__(self, path: str | Path, max_bytes: int = DEFAULT_TRACE_FILE_MAX_BYTES,
                 backups: int = DEFAULT_TRACE_FILE_BACKUPS) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max(1, int(max_bytes))
        self.backups = max(0, int(backups))
        self._lock = threading.Lock()
        self._lock_path = self.path.with_name(self.path.name + ".lock")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_to_dict(s), default=str) + "\n" for s in spans).encode()
        try:
            with self._lock:
                lock_fd = os.open(self._lock_path, os.O_WRONLY | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX)
                    self._rotate_if_full(len(data))
                    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                    try:
                        os.write(fd, data)
                    finally:
                        os.close(fd)
                finally:
                    os.close(lock_fd)  # releases the flock
        except OSError as exc:
            log.warning("cannot write spans to %s: %s", self.path, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def _rotate_if_full(self, incoming: int) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size == 0 or size + incoming <= self.max_bytes:
            return
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
            return
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))

    def shutdown(self) -> None:
        return None


def default_trace_file() -> Path:
    return Path(os.environ.get("CANTATA_TRACE_FILE") or Path(tempfile.gettempdir()) / "cantata" / "traces.jsonl")


def _exporter_names(env: Mapping[str, str]) -> list[str]:
    named = env.get("OTEL_TRACES_EXPORTER", "").strip()
    if named:
        return [n.strip().lower() for n in named.split(",") if n.strip()]
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return ["otlp"]
    return ["file"]


def _int_env(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise TelemetryConfigError(f"{name}={raw!r} is not an integer") from None


def span_limits_from_env(env: Mapping[str, str]) -> SpanLimits:
    """The SDK's span limits, with attribute values capped at OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT,
    else OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT, else 1024 characters (the SDK's own default is no cap:
    one request with a 1 MB `model` would write megabytes of spans)."""
    length = _int_env(env, "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", DEFAULT_ATTRIBUTE_VALUE_LENGTH)
    span_length = _int_env(env, "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", length)
    return SpanLimits(max_attribute_length=length, max_span_attribute_length=span_length)


def tracer_provider_from_env(component: str, env: Mapping[str, str] | None = None) -> TracerProvider:
    """A TracerProvider for one process part ("router", "specialist:cpp"), exporters from env."""
    env = os.environ if env is None else env
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", "cantata"),
                                "cantata.component": component})
    provider = TracerProvider(resource=resource, span_limits=span_limits_from_env(env))
    for name in _exporter_names(env):
        if name == "none":
            continue
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            if env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf") not in ("http/protobuf", "http"):
                log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: only http/protobuf is installed; using it",
                            env.get("OTEL_EXPORTER_OTLP_PROTOCOL"))
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name == "file":
            path = Path(env.get("CANTATA_TRACE_FILE") or default_trace_file())
            exporter = JsonlSpanExporter(
                path, _int_env(env, "CANTATA_TRACE_FILE_MAX_BYTES", DEFAULT_TRACE_FILE_MAX_BYTES) or 1,
                _int_env(env, "CANTATA_TRACE_FILE_BACKUPS", DEFAULT_TRACE_FILE_BACKUPS) or 0)
            provider.add_span_processor(SimpleSpanProcessor(exporter))
            log.info("%s: spans go to %s", component, path)
        else:
            raise TelemetryConfigError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (otlp, console, file, none)")
    return provider


# ---- propagation ---------------------------------------------------------------------------------


def inject_context(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """The W3C traceparent (and tracestate) of `ctx` (default: the current context)."""
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=ctx)
    return carrier


def extract_context(carrier: Mapping[str, str] | None) -> otel_context.Context:
    """A context whose parent span is the one in `carrier` (an empty context when there is none)."""
    return TraceContextTextMapPropagator().extract(dict(carrier or {}), context=otel_context.Context())


# ---- one generation ------------------------------------------------------------------------------


def wall_ns_from_monotonic(t: float) -> int:
    """A time.monotonic() reading as wall-clock nanoseconds (what span timestamps use)."""
    return time.time_ns() - int((time.monotonic() - t) * 1e9)


@dataclass
class GenerationTimeline:
    """Wall-clock marks (ns) of one generation, taken by the specialist around the engine."""

    submitted_ns: int  # the specialist accepted the request
    admitted_ns: int | None = None  # the engine took it (add_request)
    first_token_ns: int | None = None
    finished_ns: int | None = None
    token_marks: list[tuple[int, int]] = field(default_factory=list)  # (time_ns, tokens so far)

    def mark(self, num_tokens: int) -> None:
        now = time.time_ns()
        if self.first_token_ns is None and num_tokens > 0:
            self.first_token_ns = now
        self.token_marks.append((now, num_tokens))

    def inter_token_s(self) -> list[float]:
        """Seconds between successive tokens (a snapshot bringing k tokens counts k gaps)."""
        gaps: list[float] = []
        for (t0, n0), (t1, n1) in zip(self.token_marks, self.token_marks[1:]):
            k = n1 - n0
            if k > 0:
                gaps += [(t1 - t0) / 1e9 / k] * k
        return gaps

    def time_of_token(self, index: int) -> int | None:
        """When the output holding token `index` (0-based) arrived."""
        for t, n in self.token_marks:
            if n > index:
                return t
        return None


DECODE_ATTRIBUTES = ("drafted", "accepted", "mean_accepted_length", "acceptance_rate", "rollbacks", "steps",
                     "spec_steps", "draft_s", "verify_s", "commit_s", "accepted_by_position", "ks",
                     "grammar_steps", "grammar_drafts", "grammar_masked_drafts", "grammar_mask_s")


def _attr(value: Any) -> Any:
    """An OpenTelemetry attribute value (None and unsupported types are dropped by the caller)."""
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
        return list(value)
    return None


def decode_attributes(stats: Mapping[str, Any], speculation: str, completion_tokens: int) -> dict[str, Any]:
    attrs: dict[str, Any] = {"cantata.speculation": speculation, "cantata.completion_tokens": completion_tokens}
    for key in DECODE_ATTRIBUTES:
        value = _attr(stats.get(key))
        if value is not None:
            attrs[f"cantata.{key}"] = value
    attrs.setdefault("cantata.drafted", 0)
    attrs.setdefault("cantata.accepted", 0)
    attrs.setdefault("cantata.rollbacks", 0)
    attrs.setdefault("cantata.mean_accepted_length", 1.0)
    return attrs


def record_generation_spans(
    tracer: trace.Tracer,
    parent: otel_context.Context,
    timeline: GenerationTimeline,
    stats: Mapping[str, Any],
    speculation: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> None:
    """Emit the queue, prefill and decode spans of one generation under `parent`.

    Engine statistics, when present, place the boundaries: `queue_s` (arrival to first scheduling)
    and `ttft_s`; otherwise the specialist's own marks are used (admission by the engine thread,
    first token). Trigger events (tool_open, tool_close, eos, ...) become events of the decode span,
    stamped with the time the token they refer to arrived.
    """
    end = timeline.finished_ns or time.time_ns()
    start = timeline.submitted_ns
    admitted = timeline.admitted_ns or start
    scheduled = admitted
    if isinstance(stats.get("first_scheduled_time"), (int, float)):
        scheduled = max(admitted, min(end, wall_ns_from_monotonic(stats["first_scheduled_time"])))
    elif isinstance(stats.get("queue_s"), (int, float)):
        scheduled = min(end, admitted + int(stats["queue_s"] * 1e9))
    first = timeline.first_token_ns or end
    first = max(scheduled, min(first, end))

    queue = tracer.start_span("queue", context=parent, start_time=start)
    queue.set_attribute("cantata.queue_s", (scheduled - start) / 1e9)
    queue.end(end_time=scheduled)

    prefill = tracer.start_span("prefill", context=parent, start_time=scheduled)
    prefill.set_attribute("cantata.prompt_tokens", prompt_tokens)
    if isinstance(stats.get("prefix_hit_tokens"), int):
        prefill.set_attribute("cantata.prefix_hit_tokens", stats["prefix_hit_tokens"])
    prefill.end(end_time=first)

    decode = tracer.start_span("decode", context=parent, start_time=first,
                               attributes=decode_attributes(stats, speculation, completion_tokens))
    for event in stats.get("trigger_events") or []:
        try:
            name, index = str(event[0]), int(event[1])
        except (TypeError, ValueError, IndexError):
            continue
        when = timeline.time_of_token(index) or end
        decode.add_event(name, {"cantata.output_index": index}, timestamp=max(first, min(when, end)))
    decode.end(end_time=end)
