"""One `x-request-id` per request: the caller's, or a new one; echoed once on the response.

Under `serve run`, Ray Serve's proxy already does this (its RequestIdMiddleware puts the id into the
request's headers before our replica sees them, and appends it to every response), so the app built
for Serve leaves it to the proxy and only reads it. Outside Serve (the app in a test client, or
under another ASGI server) `RequestIdMiddleware` below plays the proxy's part, so a response carries
exactly one x-request-id either way. The router records the id on its request span
(`http.request.header.x-request-id`); Serve's own log lines carry the same id.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
MAX_LENGTH = 128  # what goes into a span of a caller-chosen id


def request_id_of(headers: Mapping[str, str]) -> str:
    """The request's id as recorded (cut to MAX_LENGTH)."""
    return headers.get(HEADER, "")[:MAX_LENGTH]


class RequestIdMiddleware:
    """Pure ASGI: sets x-request-id on the request when it has none, and once on the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = MutableHeaders(scope=scope)
        request_id = headers.get(HEADER) or str(uuid.uuid4())
        if HEADER not in headers:
            headers.append(HEADER, request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)
