"""The OpenAI-compatible HTTP layer without Ray: request schemas, error shapes and statuses, models,
health before and after warm-up, response headers, SSE framing, admin policies. Real specialists
(shell, cpp) run in-process behind LocalBackend; the Serve app uses the same FastAPI app."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import TracerProvider
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from router.api import ChatCompletionRequest
from router.backends import LocalBackend, local_specialists
from router.http import build_http_app
from router.routing import Router
from router.service import ChatService
from specialists.deployment import Specialist, SpecialistOptions, TextDeltas

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
USER = [{"role": "user", "content": "What is tar?"}]


# ---- schemas -------------------------------------------------------------------------------------


def test_request_accepts_what_the_openai_client_sends():
    req = ChatCompletionRequest.model_validate({
        "model": "auto", "messages": USER, "stream": True, "stream_options": {"include_usage": True},
        "max_completion_tokens": 12, "temperature": 0.7, "stop": "\n\n", "seed": 3, "metadata": {"a": "b"},
        "store": False, "service_tier": "auto", "reasoning_effort": "low",
    })
    assert req.token_limit() == 12 and req.stop_list() == ["\n\n"] and req.stream_options.include_usage


@pytest.mark.parametrize("bad", [
    {"model": "auto", "messages": []},
    {"model": "", "messages": USER},
    {"model": "auto", "messages": [{"role": "robot", "content": "x"}]},
    {"model": "auto", "messages": USER, "stop": ["a", "b", "c", "d", "e"]},
    {"model": "auto", "messages": USER, "temperature": 3},
    {"model": "auto", "messages": USER, "tool_choice": "sometimes"},
    {"model": "auto", "messages": USER, "tools": [{"type": "function", "function": {"description": "no name"}}]},
])
def test_request_rejects(bad):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(bad)


# ---- the app -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def app_parts():
    provider = TracerProvider()
    specs = local_specialists(["shell", "cpp"], "deploy/models", tracer_provider=provider)
    service = ChatService({n: LocalBackend(s) for n, s in specs.items()}, Router(list(specs), None, "shell"), provider)
    yield service, specs
    for s in specs.values():
        s.shutdown()


@pytest.fixture(scope="module")
def client(app_parts):
    service, _ = app_parts
    with TestClient(build_http_app(service, TOKEN)) as c:
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield c


def assert_error(r, status: int, code: str | None = None, param: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize("body,status,code,param", [
    ({"model": "gpt-9", "messages": USER}, 404, "model_not_found", "model"),
    ({"model": "shell", "messages": []}, 422, "invalid_value", "messages"),
    ({"model": "shell"}, 422, "invalid_value", "messages"),
    ({"model": "shell", "messages": USER, "n": 2}, 400, None, "n"),
    ({"model": "shell", "messages": USER, "logprobs": True}, 400, None, "logprobs"),
    ({"model": "shell", "messages": USER, "tool_choice": "required"}, 400, None, "tool_choice"),
    ({"model": "shell", "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     400, None, "messages[0].content[0]"),
    ({"model": "shell", "messages": [{"role": "user", "content": "x " * 3000}]}, 400, "invalid_prompt", None),
])
def test_errors_have_openai_shape(client, body, status, code, param):
    assert_error(client.post("/v1/chat/completions", json=body), status, code, param)


def test_error_shape_for_bad_json_and_unknown_routes(client):
    assert_error(client.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}),
                 400, "invalid_json")
    assert_error(client.get("/v2/everything"), 404)
    assert_error(client.get("/v1/chat/completions"), 405)
    assert_error(client.get("/v1/models/gpt-9"), 404, "model_not_found")


def test_models(client):
    data = client.get("/v1/models").json()
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == ["auto", "shell", "cpp"]
    assert client.get("/v1/models/cpp").json()["id"] == "cpp"


def test_headers_usage_and_sse_framing(client):
    r = client.post("/v1/chat/completions", json={"model": "shell", "messages": USER, "max_tokens": 8})
    body = r.json()
    assert r.headers["x-cantata-specialist"] == "shell" and body["model"] == "shell"
    assert float(r.headers["x-cantata-route-confidence"]) == 1.0
    assert r.headers["x-speculation"] in ("on", "off", "fallback") and r.headers["x-speculation"] == body["speculation"]
    usage = body["usage"]
    assert usage["completion_tokens"] <= 8 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert body["choices"][0]["finish_reason"] in ("stop", "length")

    auto = client.post("/v1/chat/completions", json={"model": "auto", "messages": USER, "max_tokens": 4})
    assert auto.headers["x-cantata-specialist"] == "shell"  # no classifier here: the default answers
    assert auto.headers["x-cantata-route-reason"] == "fallback"

    for include in (True, False):
        with client.stream("POST", "/v1/chat/completions", json={
                "model": "cpp", "messages": USER, "max_tokens": 6, "stream": True,
                "stream_options": {"include_usage": include}}) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            assert s.headers["x-cantata-specialist"] == "cpp" and s.headers["x-speculation"]
            lines = [line for line in s.iter_lines() if line]
        assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(finals) == 1 and finals[0]["speculation"] in ("on", "off", "fallback")
        assert isinstance(finals[0]["speculation_k"], list) and (finals[0]["speculation"] != "off" or not finals[0]["speculation_k"])
        if include:
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 6
            assert all(c["usage"] is None for c in chunks[:-1])
        else:
            assert all("usage" not in c for c in chunks)


def test_stop_strings_cut_the_reply(client):
    full = client.post("/v1/chat/completions", json={"model": "shell", "messages": USER, "max_tokens": 24}).json()
    text = full["choices"][0]["message"]["content"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    cut = client.post("/v1/chat/completions", json={"model": "shell", "messages": USER, "max_tokens": 24,
                                                    "stop": [stop]}).json()
    assert cut["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


@given(st.text(alphabet="ab\ufffd", max_size=30), st.lists(st.text(alphabet="ab", min_size=1, max_size=3), max_size=2),
       st.lists(st.integers(1, 5), min_size=1, max_size=10))
@settings(max_examples=300, deadline=None)
def test_text_deltas_never_take_back_what_was_sent(final, stops, cuts):
    """Snapshots grow; unfinished ones may end in a partial character; the engine cuts the final
    text at the first stop string. Deltas add up to the final text and never run ahead of it."""
    hits = [i for i in (final.find(x) for x in stops) if i >= 0]
    finished_text = final[: min(hits)] if hits else final
    tracker, sent, pos, i = TextDeltas(stops), "", 0, 0
    while pos < len(final):
        pos += cuts[i % len(cuts)]
        i += 1
        partial = final[:pos]
        if any(x in partial for x in stops):
            break
        sent += tracker.update(partial, finished=False)
        assert finished_text.startswith(sent)
    sent += tracker.update(finished_text, finished=True)
    assert sent == finished_text


# ---- admin ---------------------------------------------------------------------------------------


def test_admin_needs_the_token(client, app_parts):
    assert_error(client.get("/admin/policies"), 401, "invalid_token")
    assert_error(client.get("/admin/policies", headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(client.put("/admin/policies/cpp", json={"mode": "off"}), 401)
    assert_error(client.put("/admin/policies/cpp", content=b"{bad"), 401)  # the token is checked first
    service, _ = app_parts
    with TestClient(build_http_app(service, None)) as no_admin:
        assert_error(no_admin.get("/admin/policies", headers=AUTH), 404)


def test_admin_put_flips_speculation_live(client, app_parts):
    _, specs = app_parts
    views = client.get("/admin/policies", headers=AUTH).json()["specialists"]
    assert set(views) == {"shell", "cpp"} and views["cpp"]["policy"]["mode"] in ("on", "off", "auto")
    pid = views["cpp"]["pid"]
    for mode in ("off", "on", "off"):
        r = client.put("/admin/policies/cpp", json={"mode": mode, "num_speculative_tokens": 2}, headers=AUTH)
        assert r.status_code == 200 and r.json()["policy"]["mode"] == mode and r.json()["ok"]
        assert specs["cpp"].engine.gate.policy.mode == mode
        chat = client.post("/v1/chat/completions", json={"model": "cpp", "messages": USER, "max_tokens": 8})
        assert chat.headers["x-speculation"] == mode
        ks = chat.json()["speculation_k"]  # the K values the request verified (fewer drafts near max_tokens)
        assert chat.headers["x-speculation-k"] == (",".join(map(str, ks)) or "0")
        assert (max(ks) == 2) if mode == "on" else (ks == [])
    assert client.get("/admin/policies/cpp", headers=AUTH).json()["pid"] == pid
    assert_error(client.put("/admin/policies/cpp", json={"mode": "sometimes"}, headers=AUTH), 422, "invalid_policy", "mode")
    assert_error(client.put("/admin/policies/cpp", json={"turbo": True}, headers=AUTH), 422, "invalid_policy")
    assert_error(client.put("/admin/policies/fortran", json={"mode": "off"}, headers=AUTH), 404)
    both = client.put("/admin/policies", headers=AUTH, json={"default": {"mode": "auto"},
                                                             "specialists": {"shell": {"mode": "off"}}})
    assert both.status_code == 200
    assert specs["shell"].engine.gate.policy.mode == "off" and specs["cpp"].engine.gate.policy.mode == "auto"
    assert_error(client.put("/admin/policies", headers=AUTH, json={"specialists": {"fortran": {}}}), 404)


# ---- readiness -----------------------------------------------------------------------------------


class GatedSpecialist(Specialist):
    """A real specialist whose warm-up waits for a test's signal."""

    release = threading.Event()

    def _warm_up(self) -> float:
        assert self.release.wait(30)
        return super()._warm_up()


def test_503_with_retry_after_until_warm():
    provider = TracerProvider()
    spec = GatedSpecialist(SpecialistOptions(name="shell", model_dir="deploy/models/shell"), tracer_provider=provider)
    service = ChatService({"shell": LocalBackend(spec)}, Router(["shell"], None, "shell"), provider)
    try:
        with TestClient(build_http_app(service)) as c:
            health = c.get("/health")
            assert_error(health, 503, "not_ready")
            assert health.headers["retry-after"] and health.json()["specialists"] == {"shell": False}
            busy = c.post("/v1/chat/completions", json={"model": "shell", "messages": USER})
            assert_error(busy, 503, "not_ready")
            assert int(busy.headers["retry-after"]) >= 1
            GatedSpecialist.release.set()
            deadline = time.monotonic() + 30
            while c.get("/health").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert c.post("/v1/chat/completions", json={"model": "shell", "messages": USER, "max_tokens": 4}).status_code == 200
    finally:
        GatedSpecialist.release.set()
        spec.shutdown()


def test_specialist_refuses_generation_before_warm_up():
    """The specialist itself answers 503 (not only the router's readiness cache)."""
    import asyncio

    class Cold(Specialist):
        release = threading.Event()

        def _warm_up(self) -> float:
            self.release.wait(60)
            return 0.0

    spec = Cold(SpecialistOptions(name="shell", model_dir="deploy/models/shell"), tracer_provider=TracerProvider())

    async def first_event():
        async for event in spec.generate({"request_id": "r", "prompt": "hi"}):
            return event

    try:
        event = asyncio.run(first_event())
        assert event["type"] == "error" and event["status"] == 503 and not spec.ready()
        spec.check_health()  # warming up is healthy, just not ready
    finally:
        Cold.release.set()
        spec.shutdown()
