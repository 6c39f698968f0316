"""The router's chat logic, independent of HTTP framework and of Ray: route a request, build the
prompt (chat template, tools, forced tool-call prefix), call the specialist backend, and turn its
events into an OpenAI chat completion or a stream of SSE chunks.

Tracing: the HTTP layer opens the request span and passes its context in; this module adds the
`route` span and carries the context to the specialist inside the GenerateRequest, where the
`specialist.generate` span and its queue/prefill/decode children continue the same trace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import TracerProvider
from pydantic import BaseModel, Field

from router.api import (
    APIError,
    BadRequestError,
    ChatCompletion,
    ChatCompletionRequest,
    Choice,
    Delta,
    InternalError,
    ModelCard,
    ModelList,
    NotFoundError,
    ResponseMessage,
    ServiceUnavailableError,
    Usage,
    completion_id,
)
from router.backends import BackendUnavailable, SpecialistBackend
from router.limits import RequestLimits
from router.request_guard import check_request
from router.recovery import Recovery
from router.routing import AUTO, RouteDecision, Router, UnknownModelError
from router.tool_stream import ToolCallStreamer
from router.tools import ToolPlan, extract_tool_calls_off_loop, plan_tools, response_grammar, to_template_messages
from specialists.chat import render
from specialists.telemetry import TRACER_NAME, inject_context
from specialists.wire import GenerateEvent, GenerateRequest

log = logging.getLogger(__name__)


class ServiceSettings(BaseModel):
    default_max_tokens: int = Field(256, ge=1)  # when the request names none
    default_temperature: float = Field(0.0, ge=0.0, le=2.0)  # greedy unless asked (tiny models)
    ready_timeout_s: float = Field(2.0, gt=0.0)
    retry_after_s: int = Field(5, ge=1)
    recovery_wait_s: float = Field(15.0, ge=0.0)  # how long a request waits for a dead replica's restart
    limits: RequestLimits = Field(default_factory=RequestLimits)  # router/limits.py


@dataclass
class Prepared:
    request: ChatCompletionRequest
    decision: RouteDecision
    plan: ToolPlan
    generate: GenerateRequest
    backend: SpecialistBackend
    completion_id: str
    created: int
    attempts: int = 0  # sends to the specialist so far (a second one only after its replica died)


@dataclass
class Completed:
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class OpenedStream:
    headers: dict[str, str]
    chunks: AsyncIterator[str]  # SSE lines ("data: ...\n\n"), [DONE] last


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def speculation_ks(stats: Mapping[str, Any] | None) -> list[int]:
    """The K values (drafts per step) a finished request verified, from the engine's stats ([] when
    it never speculated)."""
    ks = (stats or {}).get("ks") or []
    return [int(k) for k in ks]


def sse(data: Mapping[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def error_from_event(event: GenerateEvent) -> APIError:
    if event.status == 400:
        return BadRequestError(event.message, code="invalid_prompt")
    if event.status == 503:
        return ServiceUnavailableError(event.message)
    return InternalError(event.message or "the specialist failed")


class ChatService:
    def __init__(self, backends: Mapping[str, SpecialistBackend], router: Router, tracer_provider: TracerProvider,
                 settings: ServiceSettings | None = None) -> None:
        self.backends = dict(backends)
        self.router = router
        self.settings = settings or ServiceSettings()
        self.tracer = tracer_provider.get_tracer(TRACER_NAME)
        self.tracer_provider = tracer_provider
        self.created = int(time.time())
        self._ready: set[str] = set()
        self.recovery = Recovery(self._probe, self.settings.recovery_wait_s, self.settings.retry_after_s)

    # ---- models and readiness --------------------------------------------------------------------

    def models(self) -> ModelList:
        names = [AUTO, *self.backends]
        return ModelList(data=[ModelCard(id=n, created=self.created) for n in names])

    async def health(self) -> dict[str, bool]:
        names = list(self.backends)
        results = await asyncio.gather(*(self._probe(n) for n in names))
        return dict(zip(names, results))

    async def _probe(self, name: str) -> bool:
        try:
            ok = bool(await asyncio.wait_for(self.backends[name].ready(self.settings.ready_timeout_s),
                                             self.settings.ready_timeout_s))
        except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - a replica still starting
            log.debug("%s not ready: %r", name, exc)
            ok = False
        if ok:
            self._ready.add(name)
        else:
            self._ready.discard(name)
        return ok

    async def _ensure_ready(self, name: str) -> None:
        if name in self._ready or await self._probe(name):
            return
        raise ServiceUnavailableError(f"specialist {name!r} is warming up; retry shortly",
                                      retry_after_s=self.settings.retry_after_s)

    # ---- one request -----------------------------------------------------------------------------

    def _route(self, req: ChatCompletionRequest, parent: otel_context.Context) -> RouteDecision:
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        with self.tracer.start_as_current_span("route", context=parent) as span:
            span.set_attribute("cantata.route.model", req.model)
            try:
                decision = self.router.route(req.model, messages, tools)
            except UnknownModelError as exc:
                span.set_attribute("cantata.error", str(exc))
                raise NotFoundError(str(exc), param="model", code="model_not_found") from None
            span.set_attributes({"cantata.route.specialist": decision.specialist,
                                 "cantata.route.confidence": float(decision.confidence),
                                 "cantata.route.reason": decision.reason,
                                 "cantata.route.elapsed_ms": float(decision.elapsed_ms)})
            for name, score in decision.scores.items():
                span.set_attribute(f"cantata.route.score.{name}", float(score))
        return decision

    async def prepare(self, req: ChatCompletionRequest, parent: otel_context.Context) -> Prepared:
        # unsupported parameters, seed, surrogates, schemas: a walk over the whole request, in a worker thread
        await asyncio.to_thread(check_request, req, self.settings.limits)
        plan = plan_tools(req)
        # a forced call's grammar wins over response_format (the reply is the call); otherwise the
        # reply's text follows response_format, and under tool_choice auto no call can open in it
        fmt = response_grammar(req, self.settings.limits)
        grammar = plan.grammar if plan.forced or fmt is None else fmt
        messages = to_template_messages(req.messages)
        decision = self._route(req, parent)
        backend = self.backends.get(decision.specialist)
        if backend is None:
            raise InternalError(f"the router chose {decision.specialist!r}, which is not deployed")
        await self._ensure_ready(decision.specialist)
        try:
            prompt = await asyncio.to_thread(render, messages, plan.prompt_tools, True) + plan.forced_prefix
        except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
            raise BadRequestError(f"cannot render the conversation: {exc}", param="messages") from None
        rid = completion_id()
        temperature = self.settings.default_temperature if req.temperature is None else req.temperature
        gen = GenerateRequest(
            request_id=rid, prompt=prompt, max_tokens=req.token_limit() or self.settings.default_max_tokens,
            temperature=temperature, top_p=req.top_p if req.top_p is not None else 1.0, top_k=req.top_k or 0,
            seed=req.seed, stop=req.stop_list(), grammar=grammar, trace_context=inject_context(parent),
        )
        return Prepared(req, decision, plan, gen, backend, rid, int(time.time()))

    def headers(self, p: Prepared, speculation: str, ks: list[int] | None = None) -> dict[str, str]:
        """ks: the K values the request verified (known at the end: non-streaming answers only)."""
        out = {"x-cantata-specialist": p.decision.specialist,
               "x-cantata-route-confidence": f"{p.decision.confidence:.4f}",
               "x-cantata-route-reason": p.decision.reason,
               "x-speculation": speculation}
        if ks is not None:
            out["x-speculation-k"] = ",".join(str(k) for k in ks) or "0"
        return out

    async def complete(self, req: ChatCompletionRequest, parent: otel_context.Context) -> Completed:
        """A non-streaming chat completion."""
        p = await self.prepare(req, parent)
        text, end = await self._collect(p)
        extracted = await extract_tool_calls_off_loop(text, p.plan)
        finish = "tool_calls" if extracted.calls else ("length" if end.finish_reason == "length" else "stop")
        message = ResponseMessage(content=extracted.content, tool_calls=extracted.calls or None,
                                  tool_call_errors=extracted.errors or None)
        body = ChatCompletion(
            id=p.completion_id, created=p.created, model=p.decision.specialist,
            choices=[Choice(message=message, finish_reason=finish)],
            usage=Usage(prompt_tokens=end.prompt_tokens, completion_tokens=end.completion_tokens,
                        total_tokens=end.prompt_tokens + end.completion_tokens),
        ).model_dump()
        msg = body["choices"][0]["message"]
        for key in ("tool_calls", "tool_call_errors"):
            if msg.get(key) is None:
                msg.pop(key, None)
        body["speculation"] = end.speculation
        ks = speculation_ks(end.stats)
        body["speculation_k"] = ks
        return Completed(body, self.headers(p, end.speculation or "off", ks))

    async def open_stream(self, req: ChatCompletionRequest, parent: otel_context.Context) -> OpenedStream:
        """A streaming chat completion: the specialist has admitted the request when this returns
        (errors before that are raised here, as HTTP errors); the chunks follow."""
        p = await self.prepare(req, parent)
        events, first = await self._admit(p)
        return OpenedStream(self.headers(p, first.speculation or "off"), self._chunks(p, first, events))

    # ---- the specialist's events, with one retry after a replica's death (router/recovery.py) ------

    def _send(self, p: Prepared) -> AsyncIterator[dict[str, Any]]:
        """Send the request to its specialist; a retry gets a request id of its own."""
        gen = p.generate.model_copy(update={"request_id": f"{p.completion_id}-{p.attempts}"}) if p.attempts else p.generate
        p.attempts += 1
        return p.backend.generate(gen.model_dump()).__aiter__()

    async def _before_retry(self, p: Prepared, exc: BackendUnavailable, produced: bool = False) -> None:
        """Return when the request may be sent again; else raise the client's 503."""
        self._ready.discard(exc.specialist)
        if produced or p.attempts > 1:
            raise self.recovery.error(exc) from None
        await self.recovery.before_retry(exc)

    async def _collect(self, p: Prepared) -> tuple[str, GenerateEvent]:
        """A non-streamed answer: the text (forced prefix first) and the end event. Nothing has
        reached the client, so a replica's death is retried once."""
        text, end = p.plan.forced_prefix, None
        try:
            async for raw in self._send(p):
                event = GenerateEvent.model_validate(raw)
                if event.type == "error":
                    self._note_error(event)
                    raise error_from_event(event)
                if event.type == "text":
                    text += event.text
                elif event.type == "end":
                    end = event
        except BackendUnavailable as exc:
            await self._before_retry(p, exc)
            return await self._collect(p)
        if end is None:
            raise InternalError("the specialist ended without a result")
        return text, end

    async def _admit(self, p: Prepared) -> tuple[AsyncIterator[dict[str, Any]], GenerateEvent]:
        """Send a streamed request and wait for its first event (admission, or an error raised here)."""
        events = self._send(p)
        try:
            first = GenerateEvent.model_validate(await events.__anext__())
        except StopAsyncIteration:
            raise InternalError("the specialist ended without a result") from None
        except BackendUnavailable as exc:
            await self._before_retry(p, exc)
            return await self._admit(p)
        if first.type == "error":
            self._note_error(first)
            await _aclose(events)
            raise error_from_event(first)
        return events, first

    async def _resilient(self, p: Prepared, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[GenerateEvent]:
        """The stream's events after admission. If the replica dies before any text, the request
        is sent once more (the client has seen only the role chunk); after text, or when the
        retry cannot be made, ServiceUnavailableError is raised (the caller sends an error event)."""
        produced = False
        try:
            while True:
                try:
                    async for raw in events:
                        event = GenerateEvent.model_validate(raw)
                        produced = produced or event.type == "text"
                        yield event
                    return
                except BackendUnavailable as exc:
                    await self._before_retry(p, exc, produced)
                    events = self._send(p)
        finally:
            await _aclose(events)

    async def _chunks(self, p: Prepared, first: GenerateEvent, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        include_usage = bool(p.request.stream_options and p.request.stream_options.include_usage)
        streamer = ToolCallStreamer(p.plan)
        end: GenerateEvent | None = first if first.type == "end" else None
        resilient = self._resilient(p, events)

        def chunk(delta: Delta | None, finish: str | None = None, **extra: Any) -> str:
            data: dict[str, Any] = {"id": p.completion_id, "object": "chat.completion.chunk", "created": p.created,
                                    "model": p.decision.specialist,
                                    "choices": [{"index": 0, "delta": _drop_none(delta.model_dump()) if delta else {},
                                                 "finish_reason": finish, "logprobs": None}]}
            if include_usage:
                data["usage"] = None
            data.update(extra)
            return sse(data)

        try:
            yield chunk(Delta(role="assistant", content=""))
            for delta in await streamer.afeed(p.plan.forced_prefix):
                yield chunk(delta)
            async for event in resilient:
                if event.type == "error":
                    self._note_error(event)
                    yield sse(error_from_event(event).body())
                    yield sse("[DONE]")
                    return
                if event.type == "text":
                    for delta in await streamer.afeed(event.text):
                        yield chunk(delta)
                elif event.type == "end":
                    end = event
            for delta in await streamer.afinish():
                yield chunk(delta)
            if end is None:
                raise InternalError("the specialist ended without a result")
            finish = "tool_calls" if streamer.calls else ("length" if end.finish_reason == "length" else "stop")
            extra: dict[str, Any] = {"speculation": end.speculation, "speculation_k": speculation_ks(end.stats)}
            if streamer.errors:
                extra["tool_call_errors"] = [e.model_dump() for e in streamer.errors]
            yield chunk(Delta(), finish, **extra)
            if include_usage:
                usage = Usage(prompt_tokens=end.prompt_tokens, completion_tokens=end.completion_tokens,
                              total_tokens=end.prompt_tokens + end.completion_tokens)
                yield sse({"id": p.completion_id, "object": "chat.completion.chunk", "created": p.created,
                           "model": p.decision.specialist, "choices": [], "usage": usage.model_dump()})
            yield sse("[DONE]")
        except APIError as err:  # a replica that died mid-stream (or no end): an error event, then [DONE]
            yield sse(err.body())
            yield sse("[DONE]")
        finally:
            await _aclose(resilient)

    def _note_error(self, event: GenerateEvent) -> None:
        if event.status == 503:
            self._ready.discard(event.specialist)

    # ---- admin -----------------------------------------------------------------------------------

    def backend(self, name: str) -> SpecialistBackend:
        if name not in self.backends:
            raise NotFoundError(f"no specialist {name!r}; served: {sorted(self.backends)}", param="specialist",
                                code="specialist_not_found")
        return self.backends[name]


async def _aclose(events: AsyncIterator[Any]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:  # noqa: BLE001 - closing a finished or broken stream
            log.debug("closing the specialist stream failed", exc_info=True)
