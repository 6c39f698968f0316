"""One specialist as a Ray Serve deployment: warm-up, readiness, live policy, traced and measured
generation.

Layout:
* The engine runs in a background thread: `specialists.engine_loop.EngineLoop` (requests go in,
  `Admitted` / `Snapshot` / `Failed` items come back on an asyncio.Queue).
* `GenerateRequest` / `GenerateEvent` (in the torch-free `specialists.wire`): what the router sends
  and what comes back, as dicts; `TextDeltas` turns cumulative snapshots into stream-safe text deltas.
* Metrics: the `SpecialistMetrics` interface is in `specialists.metrics`; `replica_metrics` (here, the
  one place on the specialist side that imports Ray) hands ray.serve.metrics to
  `specialists.serve_metrics.ServeMetrics` inside a Serve replica.
* `Specialist`: plain Python (usable without Ray); `specialist_deployment()` wraps it with
  `serve.deployment`. Warm-up runs in the engine thread right after the model loads; until it is
  done `ready()` is False and `generate` answers with a 503 event. `reconfigure(user_config)` (Serve,
  on start and on every `serve deploy`) and `set_policy` (the admin API) switch the speculation
  policy live. Each generation is one span under the router's (trace context carried in the
  request) with queue, prefill and decode children.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from policies.policy import SpeculationPolicy
from specialists.engine_loop import EngineLoop, Failed, Snapshot, warm_up_engine
from specialists.metrics import NullMetrics, SpecialistMetrics
from specialists.grammar import GrammarError
from specialists.prompt_guard import PromptEncoder, PromptTooLong
from specialists.sampling import SamplingParams
from specialists.serve_metrics import ServeMetrics
from specialists.telemetry import (
    TRACER_NAME,
    GenerationTimeline,
    extract_context,
    record_generation_spans,
    tracer_provider_from_env,
)
from specialists.wire import GenerateEvent, GenerateRequest

log = logging.getLogger(__name__)


# ---- the request and its events ------------------------------------------------------------------


class TextDeltas:
    """New text from cumulative snapshots: an unfinished snapshot holds back a trailing partial UTF-8
    character and any tail that may begin a stop string, so nothing sent is ever taken back."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.sent = ""

    def update(self, text: str, finished: bool) -> str:
        stable = text
        if not finished:
            stable = stable.rstrip("\ufffd")
            hold = max((_suffix_prefix(stable, s) for s in self.stop), default=0)
            stable = stable[: len(stable) - hold]
        if not stable.startswith(self.sent):
            log.warning("text changed behind what was streamed (%r -> %r); sending nothing for it", self.sent, stable)
            return ""
        delta, self.sent = stable[len(self.sent):], stable
        return delta


def _suffix_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def sampling_params(req: GenerateRequest) -> SamplingParams:
    """The engine's sampling parameters for a request (ValueError for a combination it refuses)."""
    return SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                          seed=req.seed, stop=list(req.stop))


def replica_metrics(name: str) -> SpecialistMetrics:
    """Ray Serve metrics inside a replica; no-op metrics elsewhere (tests, scripts)."""
    if "ray.serve" not in sys.modules:  # a replica has imported Serve long before it builds us
        return NullMetrics()
    try:
        from ray import serve

        serve.get_replica_context()
    except Exception:  # noqa: BLE001 - not in a Serve replica (or Ray not installed)
        return NullMetrics()
    from ray.serve import metrics

    return ServeMetrics(name, metrics)


# ---- the specialist ------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SpecialistOptions(BaseModel):
    """How one specialist replica loads its model (the deployment's constructor argument)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    model_dir: str
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_num_seqs: int = Field(16, ge=1)
    max_model_len: int | None = Field(None, ge=16)
    num_threads: int | None = Field(1, ge=1)  # torch intra-op threads; None leaves torch's default
    warmup: bool = True


class Specialist:
    """One specialist: engine in a background thread, warm-up, live policy, traced generation.

    Plain Python (tests use it directly); `specialist_deployment()` makes it a Serve deployment, in
    which Serve calls `reconfigure(user_config)` and `check_health()`, and the router calls
    `generate` (streaming), `ready`, `status`, `get_policy` and `set_policy` through a handle.
    """

    def __init__(self, options: SpecialistOptions | dict[str, Any], tracer_provider: TracerProvider | None = None,
                 metrics: SpecialistMetrics | None = None) -> None:
        from specialists.engine import Engine, RequestError

        self.options = SpecialistOptions.model_validate(options)
        self.name = self.options.name
        self.started_at = time.time()
        if self.options.num_threads is not None and self.options.device == "cpu":
            torch.set_num_threads(self.options.num_threads)
        self._provider = tracer_provider or tracer_provider_from_env(f"specialist:{self.name}")
        self._tracer = self._provider.get_tracer(TRACER_NAME)
        self._metrics = metrics or replica_metrics(self.name)
        t0 = time.perf_counter()
        self.engine = Engine.from_pretrained(self.options.model_dir, device=self.options.device,
                                             dtype=_DTYPES[self.options.dtype], max_num_seqs=self.options.max_num_seqs,
                                             max_model_len=self.options.max_model_len)
        log.info("%s: loaded %s in %.1f s", self.name, self.options.model_dir, time.perf_counter() - t0)
        self._loop = EngineLoop(self.engine, self.name, RequestError)
        self._encoder = PromptEncoder(self.engine.tokenizer, self.engine.cfg.max_model_len, self.name)
        self._warm = threading.Event()
        self._warmup_error: BaseException | None = None
        if self.options.warmup:
            self._loop.call(self._warm_up).add_done_callback(self._warmed)
        else:
            self._warm.set()

    # ---- readiness ---------------------------------------------------------------------------------

    def _warm_up(self) -> float:  # engine thread
        return warm_up_engine(self.engine)

    def _warmed(self, fut: concurrent.futures.Future) -> None:
        if fut.exception() is not None:
            self._warmup_error = fut.exception()
            log.error("%s: warm-up failed: %r", self.name, self._warmup_error)
            return
        log.info("%s: warmed up in %.2f s", self.name, fut.result())
        self._warm.set()
        self._metrics.set_status(self.speculation_status())

    def ready(self) -> bool:
        return self._warm.is_set() and self._loop.alive

    def check_health(self) -> None:
        """Serve's health check: fails when the engine thread died or warm-up failed (Serve then
        replaces the replica). A replica that is still warming up is healthy, not ready."""
        if self._warmup_error is not None:
            raise RuntimeError(f"{self.name}: warm-up failed: {self._warmup_error!r}")
        if not self._loop.alive:
            raise RuntimeError(f"{self.name}: engine loop stopped: {self._loop.error!r}")

    def status(self) -> dict[str, Any]:
        return {"specialist": self.name, "ready": self.ready(), "speculation": self.speculation_status(),
                "engine_alive": self._loop.alive, "pid": os.getpid(), "started_at": self.started_at}

    # ---- policy ------------------------------------------------------------------------------------

    def speculation_status(self) -> str:
        """What a request admitted now would use: the gate's status (a fallback whose cooldown is
        over probes, so it counts as on)."""
        if self.engine.drafter is None:
            return "off"
        snap = self.engine.gate.snapshot()
        status = str(snap.get("status", "off"))
        if status == "fallback" and snap.get("probe_in_s") == 0.0:
            return "on"
        return status

    def _policy_dict(self) -> dict[str, Any]:
        gate = self.engine.gate
        return {"specialist": self.name, "policy": gate.policy.model_dump(), "gate": gate.snapshot(),
                "speculation": self.speculation_status(), "step_times": self.engine.step_times.as_dict(),
                "pid": os.getpid(), "started_at": self.started_at}

    async def _apply(self, policy: SpeculationPolicy) -> dict[str, Any]:
        await self._loop.acall(lambda: self.engine.set_policy(policy))
        self._metrics.set_status(self.speculation_status())
        log.info("%s: policy %s", self.name, policy.model_dump())
        return self._policy_dict()

    async def reconfigure(self, user_config: dict[str, Any] | None) -> None:
        """Serve calls this with the deployment's user_config ({"speculation": {...}}) at start and on
        every `serve deploy` that changes it; the policy applies from the next engine step."""
        await self._apply(SpeculationPolicy.from_user_config(user_config))

    async def get_policy(self) -> dict[str, Any]:
        return self._policy_dict()

    async def set_policy(self, policy: dict[str, Any]) -> dict[str, Any]:
        """Replace the policy (the admin API). Returns {"ok", "error", ...the policy view}."""
        try:
            parsed = SpeculationPolicy.model_validate(policy)
            view = await self._apply(parsed)
        except (ValidationError, ValueError) as exc:
            return {"ok": False, "error": str(exc), **self._policy_dict()}
        return {"ok": True, "error": None, **view}

    async def metrics(self) -> dict[str, Any]:
        return await self._loop.acall(self.engine.metrics)

    # ---- generation --------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest | dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream GenerateEvent dicts: start, text..., end (or error). Never raises for a bad request."""
        try:
            req = GenerateRequest.model_validate(request)
        except ValidationError as exc:
            yield self._event("error", status=400, message=str(exc))
            return
        parent = extract_context(req.trace_context)
        span = self._tracer.start_span("specialist.generate", context=parent, kind=SpanKind.SERVER,
                                       attributes={"cantata.specialist": self.name, "cantata.request_id": req.request_id,
                                                   "cantata.max_tokens": req.max_tokens})
        ctx = trace.set_span_in_context(span, parent)
        try:
            if not self.ready():
                span.set_attribute("cantata.error", "not ready")
                yield self._event("error", status=503, message=f"specialist {self.name} is warming up")
                return
            async for event in self._generate(req, span, ctx):
                yield event
        finally:
            span.end()

    async def _generate(self, req: GenerateRequest, span: Span, ctx: Any) -> AsyncIterator[dict[str, Any]]:
        timeline = GenerationTimeline(time.time_ns())
        admission = self.speculation_status()
        span.set_attribute("cantata.speculation.admission", admission)
        prepared = await self._prepare(req, span)
        if isinstance(prepared, dict):  # a 400 for the request
            yield prepared
            return
        params, ids = prepared
        items = self._loop.submit(ids, params, req.request_id)
        deltas = TextDeltas(req.stop)
        last: Snapshot | None = None
        try:
            first = await items.get()  # Admitted, or Failed for a request the engine refused
            if isinstance(first, Failed):
                span.set_status(Status(StatusCode.ERROR, first.message))
                yield self._event("error", status=first.status, message=first.message)
                return
            timeline.admitted_ns = first.time_ns
            yield self._event("start", speculation=admission)
            while last is None or not last.finished:
                batch = [await items.get()]
                while not items.empty():
                    batch.append(items.get_nowait())
                text = ""
                for item in batch:
                    if isinstance(item, Failed):
                        span.set_status(Status(StatusCode.ERROR, item.message))
                        yield self._event("error", status=item.status, message=item.message)
                        return
                    timeline.token_marks.append((item.time_ns, item.num_tokens))
                    if timeline.first_token_ns is None and item.num_tokens > 0:
                        timeline.first_token_ns = item.time_ns
                    text += deltas.update(item.text, item.finished)
                    last = item
                if last is not None and (text or last.finished):
                    yield self._event("text", text=text, speculation=last.speculation,
                                      prompt_tokens=last.prompt_tokens, completion_tokens=last.num_tokens)
        finally:
            if last is None or not last.finished:
                self._loop.abort(req.request_id)
        timeline.finished_ns = last.time_ns
        self._finish(ctx, timeline, last)
        span.set_attributes({"cantata.speculation": last.speculation, "cantata.finish_reason": last.finish_reason or "",
                             "cantata.completion_tokens": last.num_tokens})
        if last.finish_reason == "grammar_error":  # the engine ended it: its grammar allowed no token (a 400)
            yield self._event("error", status=400, message="the request's grammar allows no token at this point of "
                              "the reply (a schema with no finite JSON value?)")
            return
        yield self._event("end", speculation=last.speculation, finish_reason=last.finish_reason,
                          prompt_tokens=last.prompt_tokens, completion_tokens=last.num_tokens, stats=last.stats)

    async def _prepare(self, req: GenerateRequest, span: Span) -> tuple[SamplingParams, list[int]] | dict[str, Any]:
        """The engine's parameters (the grammar compiled, or found in the cache) and the prompt's ids, both
        made off the engine thread; or the error event of a request that cannot be served."""
        try:
            params = sampling_params(req)
        except ValueError as exc:
            return self._event("error", status=400, message=str(exc))
        if req.grammar is not None:
            span.set_attribute("cantata.grammar", req.grammar.kind)
            try:
                params.grammar = await asyncio.to_thread(self.engine.grammar, req.grammar)
            except GrammarError as exc:
                return self._event("error", status=400, message=str(exc))
        try:  # tokenized after a length bound
            ids = await self._encoder.encode_async(req.prompt)
        except PromptTooLong as exc:
            return self._event("error", status=400, message=str(exc))
        except Exception as exc:  # noqa: BLE001 - text the tokenizer cannot take is the request's fault
            return self._event("error", status=400, message=f"cannot tokenize the prompt: {type(exc).__name__}")
        return params, ids

    def _finish(self, ctx: Any, timeline: GenerationTimeline, last: Snapshot) -> None:
        record_generation_spans(self._tracer, ctx, timeline, last.stats, last.speculation, last.prompt_tokens,
                                last.num_tokens)
        ttft = ((timeline.first_token_ns - timeline.submitted_ns) / 1e9) if timeline.first_token_ns else None
        decode_s = ((timeline.finished_ns or 0) - (timeline.first_token_ns or 0)) / 1e9 if timeline.first_token_ns else 0.0
        self._metrics.observe(ttft, timeline.inter_token_s(), last.num_tokens, decode_s, last.stats, last.speculation)
        self._metrics.set_status(self.speculation_status())

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return GenerateEvent(type=kind, specialist=self.name, **fields).model_dump()

    def shutdown(self) -> None:
        self._loop.stop()
        self._encoder.close()
        self._provider.shutdown()

    def __del__(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is not None:
            loop.stop(timeout_s=0.1)


HEALTH_CHECK_PERIOD_S = 2.0  # Serve's default is 10 s: up to 10 s more before a killed replica restarts


def specialist_deployment(**options: Any) -> Any:
    """The Serve deployment of `Specialist` (Ray is imported here, not at module import).

    Options are Serve deployment options (name, ray_actor_options, ...); the config file's
    per-deployment settings override them. Health is checked every 2 s: Serve notices a dead
    replica only at its next health check, so the period bounds how long a restart waits to begin
    (the check itself is a few attribute reads). A long first warm-up (GPU capture) is covered by the
    readiness check, not the health check."""
    from ray import serve

    defaults: dict[str, Any] = {"max_ongoing_requests": 64, "health_check_period_s": HEALTH_CHECK_PERIOD_S,
                                "health_check_timeout_s": 30.0, "graceful_shutdown_timeout_s": 5.0}
    return serve.deployment(Specialist, **{**defaults, **options})
