"""A specialist whose replica dies, seen from the router without Ray: the retry of a request that has
produced nothing, the SSE error event of a stream cut after text, 503s in OpenAI's shape, and one
x-request-id per response. A real specialist (shell) runs in-process; `DiesOnce` raises the error
that router/app.py raises for Ray's ActorDiedError and friends, at a chosen event of the first call,
and answers not-ready for a while as a restarting replica does. tests/test_serve_e2e.py kills a real
replica process under `serve run`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import TracerProvider

from router.backends import BackendUnavailable, LocalBackend, local_specialists
from router.http import build_http_app
from router.recovery import Recovery
from router.routing import Router
from router.service import ChatService, ServiceSettings

QUESTION = [{"role": "user", "content": "What is the `tar` command?"}]


class DiesOnce:
    """LocalBackend, except that the first `deaths` calls to generate die after `after` events
    (`restarts`: as a dead replica, which Serve restarts; else as back pressure), and `ready` is
    False for `down_s` after each death."""

    def __init__(self, inner: LocalBackend, after: int, deaths: int = 1, restarts: bool = True,
                 down_s: float = 0.3) -> None:
        self.inner, self.name = inner, inner.name
        self.after, self.deaths, self.restarts, self.down_s = after, deaths, restarts, down_s
        self.request_ids: list[str] = []
        self.down_until = 0.0

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self.request_ids.append(request["request_id"])
        dies = len(self.request_ids) <= self.deaths
        events = self.inner.generate(request).__aiter__()
        try:
            n = 0
            async for event in events:
                if dies and n == self.after:
                    self.down_until = time.monotonic() + self.down_s
                    reason = "replica_died" if self.restarts else "overloaded"
                    raise BackendUnavailable(self.name, reason, "ActorDiedError", restarts=self.restarts)
                yield event
                n += 1
        finally:
            await events.aclose()

    async def ready(self, timeout_s: float) -> bool:
        return time.monotonic() >= self.down_until and await self.inner.ready(timeout_s)

    async def get_policy(self) -> dict[str, Any]:
        return await self.inner.get_policy()

    async def set_policy(self, policy: dict[str, Any]) -> dict[str, Any]:
        return await self.inner.set_policy(policy)


@pytest.fixture(scope="module")
def shell():
    provider = TracerProvider()
    spec = local_specialists(["shell"], "deploy/models", tracer_provider=provider)["shell"]
    backend = LocalBackend(spec)
    asyncio.run(backend.wait_ready(120))
    yield backend, provider
    spec.shutdown()


def client_for(shell, backend: Any, wait_s: float = 5.0, request_ids: bool = True) -> TestClient:
    _, provider = shell
    settings = ServiceSettings(recovery_wait_s=wait_s, retry_after_s=2)
    service = ChatService({"shell": backend}, Router(["shell"], None, "shell"), provider, settings)
    return TestClient(build_http_app(service, request_ids=request_ids))


def chat(c: TestClient, stream: bool, **kw: Any):
    body = {"model": "shell", "messages": QUESTION, "max_tokens": 24, "stream": stream, **kw}
    return c.post("/v1/chat/completions", json=body)


def sse_data(text: str) -> list[str]:
    lines = [line for line in text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines), text
    return [line[6:] for line in lines]


def streamed_text(datas: list[str]) -> str:
    chunks = [json.loads(d) for d in datas if d != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


@pytest.fixture(scope="module")
def reference(shell) -> str:
    """The greedy answer of an unharmed specialist."""
    with client_for(shell, shell[0]) as c:
        r = chat(c, stream=False)
    assert r.status_code == 200
    return r.json()["choices"][0]["message"]["content"]


def assert_unavailable_body(body: dict, code: str) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "service_unavailable" and body["error"]["code"] == code
    assert "shell" in body["error"]["message"]


@pytest.mark.parametrize("after", [0, 1])  # before admission; admitted (role chunk sent) but no text yet
def test_stream_that_produced_nothing_is_retried_once(shell, reference, after):
    backend = DiesOnce(shell[0], after=after)
    with client_for(shell, backend) as c:
        r = chat(c, stream=True)
    assert r.status_code == 200
    datas = sse_data(r.text)
    assert datas[-1] == "[DONE]" and not any('"error"' in d for d in datas)
    assert streamed_text(datas) == reference  # greedy: the retry answers what the first send would have
    first = backend.request_ids[0]
    assert backend.request_ids == [first, f"{first}-1"]  # a retry gets a request id of its own


def test_stream_cut_after_text_ends_with_an_error_event_then_done(shell, reference):
    backend = DiesOnce(shell[0], after=3)  # start, then two text events reach the client
    with client_for(shell, backend) as c:
        r = chat(c, stream=True)
    assert r.status_code == 200
    datas = sse_data(r.text)
    assert datas[-1] == "[DONE]"
    assert_unavailable_body(json.loads(datas[-2]), "specialist_replica_died")
    assert streamed_text(datas[:-2]) and reference.startswith(streamed_text(datas[:-2]))
    assert len(backend.request_ids) == 1  # text reached the client: never sent twice


def test_non_stream_is_retried_even_after_text(shell, reference):
    backend = DiesOnce(shell[0], after=3)  # nothing reached the client yet
    with client_for(shell, backend) as c:
        r = chat(c, stream=False)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == reference
    assert len(backend.request_ids) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_second_death_gives_503_with_retry_after(shell, stream):
    backend = DiesOnce(shell[0], after=0, deaths=2)
    with client_for(shell, backend) as c:
        r = chat(c, stream=stream)
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert_unavailable_body(r.json(), "specialist_replica_died")
    assert len(backend.request_ids) == 2


def test_no_restart_within_the_wait_gives_503(shell):
    backend = DiesOnce(shell[0], after=0, down_s=30.0)
    with client_for(shell, backend, wait_s=0.5) as c:
        start = time.monotonic()
        r = chat(c, stream=False)
        waited = time.monotonic() - start
    assert r.status_code == 503 and r.headers["retry-after"] == "2" and len(backend.request_ids) == 1
    assert_unavailable_body(r.json(), "specialist_replica_died")
    assert 0.5 <= waited < 5.0  # bounded by recovery_wait_s (plus one readiness probe)


def test_back_pressure_is_not_retried(shell):
    backend = DiesOnce(shell[0], after=0, restarts=False)
    with client_for(shell, backend) as c:
        r = chat(c, stream=True)
    assert r.status_code == 503 and r.headers["retry-after"] == "2" and len(backend.request_ids) == 1
    assert_unavailable_body(r.json(), "specialist_overloaded")


def test_waiters_share_one_readiness_poll():
    """Ten requests waiting on one restart probe the specialist once per backoff step, not ten times."""
    probes: list[float] = []
    up_at = time.monotonic() + 0.8

    async def probe(name: str) -> bool:
        probes.append(time.monotonic())
        return time.monotonic() >= up_at

    async def main() -> list[bool]:
        recovery = Recovery(probe, wait_s=5.0, retry_after_s=2)
        return await asyncio.gather(*(recovery.wait("shell") for _ in range(10)))

    assert asyncio.run(main()) == [True] * 10
    assert 2 <= len(probes) <= 4  # 0.25, 0.75, 1.75 s: backoff 0.25, 0.5, 1
    assert probes[-1] >= up_at


def test_one_x_request_id_per_response(shell):
    with client_for(shell, shell[0]) as c:
        for r in (chat(c, stream=False), chat(c, stream=True), c.get("/v1/models"), c.get("/health"),
                  chat(c, stream=False, model="nope")):
            ids = r.headers.get_list("x-request-id")
            assert len(ids) == 1 and len(ids[0]) >= 32, (r.status_code, ids)
        mine = c.post("/v1/chat/completions", json={"model": "shell", "messages": QUESTION, "max_tokens": 2},
            headers={"x-request-id": "client-chosen-id"})
        assert mine.headers.get_list("x-request-id") == ["client-chosen-id"]
    with client_for(shell, shell[0], request_ids=False) as c:  # under Serve: the proxy adds it
        assert c.get("/v1/models").headers.get_list("x-request-id") == []


# ---- the proxy's side: a router replica that dies (router/proxy_guard.py) --------------------------


async def _proxy_like(scope, receive, send) -> None:
    """What Serve's proxy does when the router replica dies: /silent ends with no response at all
    (uvicorn would send a plain-text 500), /cut starts an SSE stream and stops mid-body."""
    if scope["path"] == "/cut":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})
    elif scope["path"] == "/whole":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"ok": true}', "more_body": False})


def test_proxy_guard_finishes_what_a_dead_router_left_open():
    from router.proxy_guard import ProxyGuard

    c = TestClient(ProxyGuard(_proxy_like))  # no lifespan: the proxy's app has none
    silent = c.get("/silent", headers={"x-request-id": "abc"})
    assert silent.status_code == 503 and silent.headers["retry-after"] == "5"
    assert silent.headers.get_list("x-request-id") == ["abc"]
    assert silent.json()["error"]["code"] == "router_unavailable"
    cut = sse_data(c.get("/cut").text)
    assert cut[0] == '{"choices": []}' and cut[-1] == "[DONE]"
    assert json.loads(cut[-2])["error"]["type"] == "service_unavailable"
    whole = c.get("/whole")
    assert whole.status_code == 200 and whole.json() == {"ok": True}
