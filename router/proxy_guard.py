"""Runs inside Ray Serve's HTTP proxy, not in a replica: with
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=router.proxy_guard:middlewares` in the environment of
`serve run`, the proxy wraps its ASGI app in `ProxyGuard`.

When the router replica dies with a request in flight, the proxy ends that request without an
answer (uvicorn then sends a plain-text 500) or stops a stream mid-body. ProxyGuard finishes such a
request in OpenAI's shape instead: a 503 with Retry-After and an error body when nothing was sent
yet, or an SSE error event and `data: [DONE]` when a stream was cut. Responses that complete are
passed through untouched; the 503 carries the request's x-request-id (which Serve's
RequestIdMiddleware, inside this one, has put into the request's headers). Starlette only (the proxy has no Cantata state); no Ray import.
"""

from __future__ import annotations

import json
import logging

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5
ERROR = {"error": {"message": "the router stopped while serving this request; retry shortly",
                   "type": "service_unavailable", "param": None, "code": "router_unavailable"}}


class ProxyGuard:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        seen = {"started": False, "sse": False, "done": False}

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["started"] = True
                seen["sse"] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                  for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                seen["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            if not seen["done"]:
                try:
                    await _finish(send, seen["started"], seen["sse"], scope)
                except Exception:  # noqa: BLE001 - the client has gone away as well
                    log.debug("could not finish %s", scope.get("path"), exc_info=True)


async def _finish(send: Send, started: bool, sse: bool, scope: Scope) -> None:
    """End a response the proxy left open (a client that has gone away ignores it)."""
    if started and not sse:
        return  # a JSON body cut in the middle cannot be mended
    log.warning("the router ended %s without an answer; sending %s", scope.get("path"),
                "an SSE error event" if started else "503")
    if started:
        await send({"type": "http.response.body", "more_body": False,
                    "body": f"data: {json.dumps(ERROR)}\n\ndata: [DONE]\n\n".encode()})
        return
    body = json.dumps(ERROR).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(RETRY_AFTER_S).encode()),
                            *[(k, v) for k, v in scope.get("headers", []) if k.lower() == b"x-request-id"][:1]]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def middlewares() -> list[Middleware]:
    """The proxy's callback (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH)."""
    return [Middleware(ProxyGuard)]
