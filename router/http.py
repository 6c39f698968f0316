"""The FastAPI application: OpenAI-compatible routes, health, admin, and OpenAI-shaped errors.

  POST /v1/chat/completions   JSON, or SSE with "stream": true (stream_options.include_usage adds
                              a final usage chunk)
  GET  /v1/models             "auto" and each specialist;  GET /v1/models/{id}
  GET  /health                200 when every specialist is warmed up, else 503 with Retry-After
  /admin/policies...          router/admin.py

Every chat response carries x-cantata-specialist, x-cantata-route-confidence, x-speculation,
x-request-id and x-trace-id. The request span starts here (W3C traceparent honoured) and ends
when the response (or the last SSE chunk) has been produced. FastAPI's own tracing is switched
off so it does not start a second, disconnected trace.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.admin import admin_router
from router.api import APIError, ChatCompletionRequest, ErrorDetail, ErrorResponse, ModelCard, ModelList, NotFoundError
from router.limits import BodyLimitMiddleware, RequestLimits
from router.backends import BackendUnavailable
from router.request_id import RequestIdMiddleware, request_id_of
from router.service import ChatService
from specialists.telemetry import extract_context

log = logging.getLogger(__name__)

CHAT_ROUTE = "/v1/chat/completions"
STATUS_DESCRIPTION_CHARS = 1024  # an error can quote the request (a 1 MB model name)


def _error_response(status: int, message: str, error_type: str, param: str | None = None, code: str | None = None,
                    headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    body = ErrorResponse(error=ErrorDetail(message=message, type=error_type, param=param, code=code)).model_dump()
    body.update(extra)
    return JSONResponse(body, status_code=status, headers=headers)


def _fastapi(limits: RequestLimits) -> FastAPI:
    kwargs: dict[str, Any] = {"title": "Cantata", "version": "0.1.0"}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        kwargs["telemetry"] = {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(**kwargs)
    app.add_middleware(BodyLimitMiddleware, limits=limits)  # 413 / 408 before the body is parsed
    return app


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return _error_response(400, f"the body is not valid JSON: {first.get('msg', '')}",
                                   "invalid_request_error", code="invalid_json")
        where = ".".join(loc) or "body"
        message = f"{where}: {first.get('msg', 'invalid value')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more)"
        return _error_response(422, message, "invalid_request_error", param=where, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(exc.status_code, str(exc.detail), kind, headers=getattr(exc, "headers", None))

    @app.exception_handler(BackendUnavailable)
    async def unavailable(_: Request, exc: BackendUnavailable) -> JSONResponse:  # e.g. an admin call to a dead replica
        return _error_response(503, str(exc), "service_unavailable", code=f"specialist_{exc.reason}",
                               headers={"Retry-After": "5"})

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error_response(500, f"internal error: {type(exc).__name__}", "internal_error")


def build_http_app(service: ChatService, admin_token: str | None = None, request_ids: bool = True) -> FastAPI:
    """The app. `request_ids`: set and echo x-request-id here (False under Serve, whose proxy does it)."""
    app = _fastapi(service.settings.limits)
    install_error_handlers(app)
    if request_ids:
        app.add_middleware(RequestIdMiddleware)  # router/request_id.py
    tracer = service.tracer

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = await service.health()
        if all(ready.values()):
            return JSONResponse({"status": "ok", "specialists": ready})
        waiting = sorted(n for n, ok in ready.items() if not ok)
        return _error_response(503, f"warming up: {', '.join(waiting)}", "service_unavailable", code="not_ready",
                               headers={"Retry-After": str(service.settings.retry_after_s)}, specialists=ready)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return service.models()

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str) -> ModelCard:
        for card in service.models().data:
            if card.id == model_id:
                return card
        raise NotFoundError(f"the model {model_id!r} does not exist", param="model", code="model_not_found")

    @app.post(CHAT_ROUTE)
    async def chat(request: Request, body: ChatCompletionRequest) -> Any:
        parent = extract_context(request.headers)
        span = tracer.start_span(f"POST {CHAT_ROUTE}", context=parent, kind=SpanKind.SERVER,
                                 attributes={"http.request.method": "POST", "http.route": CHAT_ROUTE,
                                             "url.path": request.url.path, "cantata.model": body.model,
                                             "cantata.stream": body.stream,
                                             "http.request.header.x-request-id": request_id_of(request.headers)})
        ctx = trace.set_span_in_context(span, parent)
        trace_id = f"{span.get_span_context().trace_id:032x}"
        try:
            if body.stream:
                opened = await service.open_stream(body, ctx)
            else:
                done = await service.complete(body, ctx)
        except APIError as exc:
            _close(span, exc.status_code, exc)
            exc.headers = {**exc.headers, "x-trace-id": trace_id}
            raise
        except Exception as exc:
            _close(span, 500, exc)
            raise
        if not body.stream:
            span.set_attributes(_span_headers(done.headers))
            _close(span, 200)
            return JSONResponse(done.body, headers={**done.headers, "x-trace-id": trace_id})
        span.set_attributes(_span_headers(opened.headers))
        return StreamingResponse(_ending(opened.chunks, span), media_type="text/event-stream",
                                 headers={**opened.headers, "x-trace-id": trace_id, "Cache-Control": "no-cache"})

    app.include_router(admin_router(service, admin_token))
    return app


def _span_headers(headers: dict[str, str]) -> dict[str, str]:
    return {f"http.response.header.{k}": v for k, v in headers.items() if k.startswith("x-")}


def _close(span: trace.Span, status: int, exc: BaseException | None = None) -> None:
    span.set_attribute("http.response.status_code", status)
    if exc is not None:
        span.set_status(Status(StatusCode.ERROR, str(exc)[:STATUS_DESCRIPTION_CHARS]))  # span limits do not cap it
        span.record_exception(exc)
    span.end()


async def _ending(chunks: AsyncIterator[str], span: trace.Span) -> AsyncIterator[str]:
    """The SSE chunks; the request span ends with the last one (or when the client goes away)."""
    try:
        async for chunk in chunks:
            yield chunk
        _close(span, 200)
    except BaseException as exc:
        _close(span, 499 if not isinstance(exc, Exception) else 500, exc)
        raise
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()
