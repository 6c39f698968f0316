"""A fuzz table against the real HTTP app over a real specialist's engine (shell, in-process, no Ray):
every top-level field, message field and tool field gets every hostile value, plus raw bodies that
are not JSON, not objects, nested too deep, in the wrong encoding or cut short. Each case must give
2xx (a well-formed completion or stream) or a 4xx in OpenAI's error shape, never a 5xx, and answer
within its timeout."""

from __future__ import annotations

import concurrent.futures
import json
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import TracerProvider

from router.backends import LocalBackend, local_specialists
from router.http import build_http_app
from router.routing import Router
from router.service import ChatService

CASE_TIMEOUT_S = 20.0
BASE: dict[str, Any] = {"model": "shell", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
HOSTILE: list[Any] = [
    None, True, False, 0, -1, 1, 2**64, -(2**70), 1.5, 1e308, "", "yes", "0.5", "\ud800", "a\x00b", [], [1], ["x"],
    {}, {"a": 1}, {"type": "text"}, "x" * 20_000, [[[[[[[[]]]]]]]],
]
FIELDS = [
    "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "stream", "stream_options", "max_tokens",
    "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "logprobs", "user",
    "top_logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "response_format", "functions",
    "function_call", "modalities", "metadata", "min_p", "some_future_field",
]
MESSAGE_FIELDS = ["role", "content", "name", "tool_calls", "tool_call_id", "refusal"]
SCHEMAS: list[Any] = [
    None, {}, [], "{}", "not json", {"type": "dict", "properties": {"a": {"type": "List[int]"}}},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, {"$ref": "#"},
    {"type": "object", "properties": {"a": {"$ref": "https://example.invalid/x"}}},
    {"type": "object", "properties": {"a": {"pattern": "(unclosed"}}}, {"type": "object", "required": "a"},
    {"type": "object", "properties": {"a": {"pattern": "^(a|aa)+$"}}}, {"properties": None}, {"type": 5},
    {"anyOf": [{"$ref": "#/anyOf/0"}]}, {"enum": []}, {"items": [{}, {}]}, {"$id": "file:///etc/passwd"},
]


def _json_cases() -> list[tuple[str, Any]]:
    cases: list[tuple[str, Any]] = []
    for field in FIELDS:
        for i, value in enumerate(HOSTILE):
            cases.append((f"{field}={i}", {**BASE, field: value}))
    for field in MESSAGE_FIELDS:
        for i, value in enumerate(HOSTILE):
            cases.append((f"message.{field}={i}", {**BASE, "messages": [{"role": "user", "content": "hi", field: value}]}))
    for i, schema in enumerate(SCHEMAS):
        tool = {"type": "function", "function": {"name": "run_shell", "parameters": schema}}
        for choice in ("auto", "required", {"type": "function", "function": {"name": "run_shell"}}):
            cases.append((f"schema={i},choice={choice if isinstance(choice, str) else 'named'}",
                          {**BASE, "max_tokens": 24, "tools": [tool], "tool_choice": choice}))
    for i, value in enumerate(HOSTILE):
        cases.append((f"tool={i}", {**BASE, "tools": [value]}))
        cases.append((f"tool.function={i}", {**BASE, "tools": [{"type": "function", "function": value}]}))
        cases.append((f"tool.name={i}", {**BASE, "tools": [{"type": "function", "function": {"name": value}}]}))
    for i, stop in enumerate([["a"] * 5, "x" * 600, ["", ""], ["\n"], [None]]):
        cases.append((f"stop={i}", {**BASE, "stop": stop}))
    for i, messages in enumerate([[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                  [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                                  [{"role": "user", "content": [{"type": "text"}]}], [{"content": "hi"}],
                                  [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
                                  [{"role": "tool", "content": "x"}] * 3, [{"role": "user", "content": "hi"}] * 2000]):
        cases.append((f"messages={i}", {**BASE, "messages": messages}))
    for i, extra in enumerate([{"stream": True}, {"stream": True, "stream_options": {"include_usage": True}},
                               {"temperature": 0.9, "seed": 7}, {"temperature": 2.0, "top_p": 0.01, "top_k": 1}]):
        cases.append((f"valid={i}", {**BASE, **extra}))
    return cases


RAW: list[tuple[str, bytes, str]] = [
    ("empty", b"", "application/json"), ("not-json", b"{nope", "application/json"), ("array", b"[]", "application/json"),
    ("string", b'"hi"', "application/json"), ("null", b"null", "application/json"), ("number", b"1e999999", "application/json"),
    ("deep-array", b"[" * 100_000, "application/json"), ("deep-object", b'{"a":' * 50_000, "application/json"),
    ("deep-extra", b'{"model":"shell","messages":[{"role":"user","content":"hi","x":' + b"[" * 900 + b"]" * 900 + b"}]}",
     "application/json"),
    ("nan", b'{"model":"shell","messages":[{"role":"user","content":"hi"}],"temperature":NaN}', "application/json"),
    ("surrogate-bytes", b'{"model":"shell","messages":[{"role":"user","content":"\xed\xa0\x80"}]}', "application/json"),
    ("latin1", b'{"model":"shell","messages":[{"role":"user","content":"caf\xe9"}]}', "application/json"),
    ("utf16", json.dumps(BASE).encode("utf-16"), "application/json"),
    ("bom", b"\xef\xbb\xbf" + json.dumps(BASE).encode(), "application/json"),
    ("form", b"model=shell", "application/x-www-form-urlencoded"), ("text", json.dumps(BASE).encode(), "text/plain"),
    ("dup-keys", b'{"model":"shell","model":"gpt","messages":[{"role":"user","content":"hi"}]}', "application/json"),
    ("huge-int", b'{"model":"shell","messages":[{"role":"user","content":"hi"}],"seed":' + b"9" * 5000 + b"}",
     "application/json"),
]
JSON_CASES = _json_cases()


def test_the_table_is_big_enough():
    assert len(JSON_CASES) + len(RAW) >= 300


@pytest.fixture(scope="module")
def client():
    provider = TracerProvider()
    specs = local_specialists(["shell"], "deploy/models", tracer_provider=provider)
    service = ChatService({n: LocalBackend(s) for n, s in specs.items()}, Router(list(specs), None, "shell"), provider)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    with TestClient(build_http_app(service), raise_server_exceptions=False) as c:
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield c, pool
    pool.shutdown(wait=False)
    for s in specs.values():
        s.shutdown()


def _check(r: Any, streamed_text: str | None) -> None:
    assert r.status_code < 500, f"{r.status_code}: {(streamed_text or r.text)[:300]}"
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/json"), r.headers
        err = json.loads(streamed_text if streamed_text is not None else r.text)["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
        return
    assert 200 <= r.status_code < 300
    if streamed_text is not None and r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in streamed_text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", streamed_text[-300:]
        assert all("error" not in json.loads(e) for e in events[:-1])
    else:
        body = json.loads(streamed_text if streamed_text is not None else r.text)
        assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def _send(c: TestClient, content: bytes, content_type: str) -> tuple[Any, str]:
    with c.stream("POST", "/v1/chat/completions", content=content, headers={"content-type": content_type}) as r:
        text = b"".join(r.iter_bytes()).decode("utf-8")
    return r, text


def _run(client, content: bytes, content_type: str) -> None:
    c, pool = client
    fut = pool.submit(_send, c, content, content_type)
    try:
        r, text = fut.result(timeout=CASE_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        pytest.fail(f"no answer within {CASE_TIMEOUT_S} s")
    _check(r, text)


@pytest.mark.parametrize("body", [b for _, b in JSON_CASES], ids=[name for name, _ in JSON_CASES])
def test_json_case(client, body):
    _run(client, json.dumps(body).encode(), "application/json")  # ensure_ascii: surrogates travel as \ud800


@pytest.mark.parametrize("raw,content_type", [(b, t) for _, b, t in RAW], ids=[name for name, _, _ in RAW])
def test_raw_case(client, raw, content_type):
    _run(client, raw, content_type)
