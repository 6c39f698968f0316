"""Request limits (`RequestLimits`, part of the router's settings and of AppArgs as `limits:`) and
the ASGI middleware that enforces the body limits before FastAPI reads a byte:

* a body larger than `max_body_bytes` gets 413, from its Content-Length before anything is read,
  or as soon as a chunked body grows past the limit;
* a body that has not fully arrived `body_read_timeout_s` after the request began (a client that
  sends less than its Content-Length, or trickles) gets 408 and `Connection: close`.

The body is read here, then replayed to the app; later `receive` calls (the disconnect that ends a
stream early) go to the server as before. Errors are in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MIB = 1024 * 1024


class RequestLimits(BaseModel):
    """What one request may carry (router settings; `limits:` in the app's args)."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(4 * MIB, ge=1024)  # 413 above this
    body_read_timeout_s: float = Field(30.0, gt=0.0)  # 408 when the body is not in by then
    max_tools: int = Field(128, ge=1)
    max_schema_bytes: int = Field(64 * 1024, ge=256)  # one tool's parameters, as compact JSON
    max_schema_depth: int = Field(32, ge=2)  # nested objects/arrays in one tool's parameters
    max_stop_chars: int = Field(512, ge=1)  # one stop sequence


def _error(status: int, message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()


async def _respond(send: Send, status: int, message: str, code: str) -> None:
    body = _error(status, message, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers") or []:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodyLimitMiddleware:
    """413 for bodies over `max_body_bytes`, 408 for bodies not in within `body_read_timeout_s`."""

    def __init__(self, app: ASGIApp, limits: RequestLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _respond(send, 413, f"the request body is {declared} bytes; the limit is {limit}", "body_too_large")
            return
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.limits.body_read_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                log.info("body not received within %.1f s: 408", self.limits.body_read_timeout_s)
                await _respond(send, 408, f"the request body did not arrive within {self.limits.body_read_timeout_s:g} s",
                               "body_timeout")
                return
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size > limit:
                await _respond(send, 413, f"the request body is over the limit of {limit} bytes", "body_too_large")
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
