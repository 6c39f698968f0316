"""Issue 14, hostile input: each hole reproduced against the real FastAPI app served by a real
uvicorn on 127.0.0.1 (in-process specialists, no Ray), and shown closed.

* tool schemas are data: a `$ref` to a file or a URL is refused (400) and never followed, a
  secret file's contents never appear, a local HTTP server is never hit, a catastrophic `pattern`
  gives up within its budget while other routes keep answering;
* bad input is a 4xx in OpenAI's shape: strict types, lone surrogates, seed range, refused
  parameters by name, body size (413), a body shorter than its Content-Length (408, closed), a
  prompt far over the model's length refused without tokenizing.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
import uvicorn
from opentelemetry.sdk.trace import TracerProvider

from router.backends import LocalBackend, local_specialists
from router.http import build_http_app
from router.limits import RequestLimits
from router.routing import Router
from router.service import ChatService, ServiceSettings
from router.tools import ToolPlan, extract_tool_calls_off_loop
from specialists.chat import validate_arguments
from specialists.prompt_guard import PromptEncoder, PromptTooLong

from serve_harness import slowest_get_while

USER = [{"role": "user", "content": "List the files in /tmp with their sizes."}]
SLOW_PATTERN = "^(?:(?:|.?)(?:|.?)){25}(?!)"  # exponential for any string, even under the `regex` engine
ISSUE_PATTERN = "^(?:|\u0001?){26}!$"  # froze every route 2.8 s under `re`
LIMITS = RequestLimits(max_body_bytes=2 * 1024 * 1024, body_read_timeout_s=1.0)


# ---- fixtures ------------------------------------------------------------------------------------


class _Hits(BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).hits.append(self.path)
        body = json.dumps({"type": "string", "const": "fetched"}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def bait():
    """A local HTTP server that must never be contacted; yields (base URL, list of paths hit)."""
    handler = type("Hits", (_Hits,), {"hits": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", handler.hits
    server.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base():
    provider = TracerProvider()
    specs = local_specialists(["shell"], "deploy/models", tracer_provider=provider)
    service = ChatService({n: LocalBackend(s) for n, s in specs.items()}, Router(list(specs), None, "shell"), provider,
                          ServiceSettings(limits=LIMITS))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(build_http_app(service), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, "the app did not come up"
        time.sleep(0.1)
    yield url
    server.should_exit = True
    thread.join(10)
    for s in specs.values():
        s.shutdown()


def post(base: str, body: dict, timeout: float = 30.0) -> requests.Response:
    return requests.post(f"{base}/v1/chat/completions", json=body, timeout=timeout)


def assert_error(r: requests.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def tool(parameters: dict, name: str = "run_shell") -> dict:
    return {"type": "function", "function": {"name": name, "description": "Run a shell command and return its output.",
                                             "parameters": parameters}}


def forced(parameters: dict, **extra) -> dict:
    return {"model": "shell", "messages": USER, "tools": [tool(parameters)], "max_tokens": 40,
            "tool_choice": {"type": "function", "function": {"name": "run_shell"}}, **extra}


# ---- tool schemas are data -----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_file_reference_is_refused_and_the_file_is_not_read(base, tmp_path, stream):
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"password": "hunter2-DO-NOT-LEAK"}))
    for ref in (f"file://{secret}#/nope", f"file://{secret}", "file:///etc/passwd#/x"):
        params = {"type": "object", "properties": {"command": {"$ref": ref}}}
        r = post(base, forced(params, stream=stream))
        err = assert_error(r, 400, "tools[0].function.parameters", "schema_reference_not_allowed")
        assert "hunter2" not in r.text and "root:" not in r.text and "properties.command.$ref" in err["message"]
    # the second line of defence: validation itself never reads it either
    problem = validate_arguments({"command": "ls"}, {"properties": {"command": {"$ref": f"file://{secret}"}}})
    assert problem is not None and "hunter2" not in problem


@pytest.mark.parametrize("stream", [False, True])
def test_url_references_are_never_fetched(base, bait, stream):
    url, hits = bait
    refused = [{"$ref": f"{url}/schema.json"}, {"$dynamicRef": f"{url}/d.json"}, {"items": [{"$ref": f"{url}/i.json"}]}]
    for sub in refused:
        r = post(base, forced({"type": "object", "properties": {"command": sub}}, stream=stream))
        assert_error(r, 400, "tools[0].function.parameters", "schema_reference_not_allowed")
    # Local references under a remote base URI pass the request check; validating them still fetches nothing.
    sneaky = {"$id": f"{url}/root.json", "$schema": f"{url}/meta.json", "type": "object",
              "properties": {"command": {"$id": f"{url}/other.json", "$ref": "#/nope"}}}
    r = post(base, forced(sneaky, stream=stream))
    assert r.status_code == 200, r.text
    if not stream:
        errors = r.json()["choices"][0]["message"].get("tool_call_errors") or []
        assert all("fetched" not in e["error"] for e in errors)
    assert validate_arguments({"command": "ls"}, sneaky) is not None
    assert validate_arguments({"command": "ls"}, {"properties": {"command": {"$ref": f"{url}/x.json"}}}) is not None
    assert hits == [], f"the router contacted {hits}"


def test_schema_limits(base):
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    assert_error(post(base, forced(deep)), 400, "tools[0].function.parameters", "schema_too_deep")
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(800)}}
    assert_error(post(base, forced(wide)), 400, "tools[0].function.parameters", "schema_too_large")
    many = {"model": "shell", "messages": USER, "tools": [tool({}, f"t{i}") for i in range(129)]}
    assert_error(post(base, many), 400, "tools", "too_many_tools")
    local = {"type": "object", "$defs": {"cmd": {"type": "string"}}, "properties": {"command": {"$ref": "#/$defs/cmd"}}}
    assert post(base, forced(local)).status_code == 200  # local references are fine


def test_catastrophic_patterns_give_up_quickly():
    for pattern in (SLOW_PATTERN, ISSUE_PATTERN):
        for schema in ({"properties": {"command": {"type": "string", "pattern": pattern}}},
                       {"patternProperties": {pattern: {"type": "string"}}},
                       {"propertyNames": {"pattern": pattern}}):
            t0 = time.monotonic()
            problem = validate_arguments({"command": "ls -la /tmp"}, schema)
            assert time.monotonic() - t0 < 2.0, (pattern, schema)
            assert problem is None or "gave up" in problem or "does not match" in problem, problem
    assert "gave up" in validate_arguments({"command": "ls"}, {"properties": {"command": {"pattern": SLOW_PATTERN}}})
    # exponentially fanning local references hit the reference budget
    defs = {f"d{i}": {"allOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(40)}
    defs["d40"] = {"type": "string"}
    t0 = time.monotonic()
    assert "gave up" in validate_arguments({"a": "x"}, {"$defs": defs, "properties": {"a": {"$ref": "#/$defs/d0"}}})
    assert time.monotonic() - t0 < 3.0


def test_validation_runs_off_the_event_loop():
    """While a slow validation runs, the event loop keeps ticking (it would stall for the whole
    validation if it ran on the loop)."""
    schema = {"type": "object", "properties": {"command": {"type": "string", "pattern": SLOW_PATTERN}}}
    plan = ToolPlan(prompt_tools=[], parse_calls=True, schemas={"run_shell": schema})
    text = '<tool_call>{"name": "run_shell", "arguments": {"command": "ls -la"}}</tool_call>'

    async def main() -> tuple[float, float, str]:
        gaps: list[float] = []
        done = asyncio.Event()

        async def tick() -> None:
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        t0 = time.monotonic()
        extracted = await extract_tool_calls_off_loop(text, plan)
        took = time.monotonic() - t0
        done.set()
        await ticker
        return took, max(gaps), extracted.errors[0].error

    took, worst_gap, error = asyncio.run(main())
    assert "gave up" in error
    assert took >= 0.08 and worst_gap < took / 2, (took, worst_gap)


def test_redos_pattern_in_a_request_keeps_other_routes_responsive(base):
    params = {"type": "object", "properties": {"command": {"type": "string", "pattern": SLOW_PATTERN},
                                               "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600}},
              "required": ["command"], "additionalProperties": False, "propertyNames": {"pattern": ISSUE_PATTERN}}
    result: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        result["r"] = post(base, forced(params, max_tokens=60))
        result["s"] = time.monotonic() - t0

    worker = threading.Thread(target=run)
    worker.start()
    worst = slowest_get_while(worker, f"{base}/v1/models", timeout=10)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert result["s"] < 20.0 and worst < 1.0, (result["s"], worst)
    message = r.json()["choices"][0]["message"]
    assert message["tool_calls"], message
    errors = [e["error"] for e in message.get("tool_call_errors") or []]
    assert any("gave up" in e for e in errors), errors


# ---- bad input is a 4xx in OpenAI's shape --------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("stream", "yes"), ("stream", 1), ("temperature", "0.5"), ("max_tokens", True), ("max_tokens", 2.0),
    ("top_p", "1"), ("seed", "3"), ("n", True), ("logprobs", "false"), ("stream_options", {"include_usage": "yes"}),
])
def test_types_are_strict(base, field, value):
    assert_error(post(base, {"model": "shell", "messages": USER, field: value}), 422, code="invalid_value")


@pytest.mark.parametrize("seed", [2**63, 2**64, 10**30, -1, -(2**70)])
def test_seed_out_of_range_is_400_naming_seed(base, seed):
    assert_error(post(base, {"model": "shell", "messages": USER, "temperature": 0.7, "seed": seed, "max_tokens": 2}),
                 400, "seed")


def test_seed_in_range_is_served(base):
    r = post(base, {"model": "shell", "messages": USER, "temperature": 0.7, "seed": 2**63 - 1, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_lone_surrogates_are_400(base):
    for content in ("\ud800", "ok \udfff then", [{"type": "text", "text": "\udbff"}]):
        body = {"model": "shell", "messages": [{"role": "user", "content": content}]}
        raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as \\ud800
        r = requests.post(f"{base}/v1/chat/completions", data=raw, headers={"content-type": "application/json"}, timeout=30)
        assert_error(r, 400, code="invalid_unicode")
    raw = b'{"model": "shell", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'  # raw CESU bytes
    r = requests.post(f"{base}/v1/chat/completions", data=raw, headers={"content-type": "application/json"}, timeout=30)
    assert_error(r, 400, "messages[0].content", "invalid_unicode")
    tool_name = {"model": "shell", "messages": [{"role": "user", "content": "hi", "name": "\ud83d"}]}
    r = requests.post(f"{base}/v1/chat/completions", data=json.dumps(tool_name), timeout=30,
                      headers={"content-type": "application/json"})
    assert_error(r, 400, "messages[0].name", "invalid_unicode")


@pytest.mark.parametrize("field,value", [
    ("logit_bias", {"42": 5}), ("presence_penalty", 0.5), ("frequency_penalty", -1.0), ("top_logprobs", 2),
    ("response_format", {"type": "regex"}),
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}), ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}), ("repetition_penalty", 1.2), ("min_p", 0.1), ("best_of", 2), ("echo", True),
    ("guided_json", {"type": "object"}), ("n", 2), ("logprobs", True),
])
def test_unsupported_parameters_are_refused_by_name(base, field, value):
    err = assert_error(post(base, {"model": "shell", "messages": USER, field: value}), 400, field)
    assert err["code"] == "unsupported_parameter"


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 0), ("frequency_penalty", 0.0), ("logit_bias", {}), ("response_format", {"type": "text"}),
    ("modalities", ["text"]), ("n", 1), ("logprobs", False), ("metadata", {"a": "b"}), ("user", "u1"),
])
def test_defaults_of_unsupported_parameters_are_served(base, field, value):
    r = post(base, {"model": "shell", "messages": USER, "max_tokens": 2, field: value})
    assert r.status_code == 200, r.text


def test_body_over_the_limit_is_413(base):
    big = {"model": "shell", "messages": [{"role": "user", "content": "x" * (LIMITS.max_body_bytes + 10)}]}
    assert_error(post(base, big), 413, code="body_too_large")

    def chunks():  # no Content-Length: the limit is enforced while the body streams in
        yield b'{"model": "shell", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}]}'

    r = requests.post(f"{base}/v1/chat/completions", data=chunks(), headers={"content-type": "application/json"},
                      timeout=30)
    assert_error(r, 413, code="body_too_large")


def test_body_shorter_than_content_length_gets_408_and_is_closed(base):
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\": ")
        t0 = time.monotonic()
        data = b""
        while True:
            part = s.recv(65536)
            if not part:
                break
            data += part
        took = time.monotonic() - t0
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b'"code":"body_timeout"' in data.replace(b" ", b"")
    assert took < LIMITS.body_read_timeout_s + 3.0, took


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "a"}] * 50_000,  # 100k took the router 5 s to validate
    [{"role": "user", "content": [{"type": "text", "text": "a"}] * 50_000}],
    [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}] * 30_000},
     {"role": "user", "content": "a"}],  # 50k took 9 s
])
def test_too_many_messages_parts_or_calls_are_refused_before_validation(base, messages):
    t0 = time.monotonic()
    err = assert_error(post(base, {"model": "shell", "messages": messages}), 422, code="invalid_value")
    assert "at most" in err["message"] and time.monotonic() - t0 < 3.0


def test_prompt_far_over_the_model_length_is_refused_without_tokenizing(base):
    r = post(base, {"model": "shell", "messages": [{"role": "user", "content": "ab " * 500_000}]})
    err = assert_error(r, 400, code="invalid_prompt")
    assert "characters" in err["message"], err


def test_prompt_encoder_bound():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained("deploy/models/shell")
    enc = PromptEncoder(tok, 2048, "t")
    try:
        assert enc.max_chars == 2048 * max(len(t) for t in tok.get_vocab())
        t0 = time.monotonic()
        with pytest.raises(PromptTooLong):
            enc.encode("a" * (enc.max_chars + 1))
        assert time.monotonic() - t0 < 0.05
        # the bound is safe: the longest-token string repeated to the bound still needs >= 2047 tokens
        longest = max(tok.get_vocab(), key=len)
        text = tok.convert_tokens_to_string([longest]) * (2048 - 1)
        assert len(text) <= enc.max_chars and len(enc.encode(text)) >= 2047 - 1
        assert asyncio.run(enc.encode_async("hello")) == tok("hello", add_special_tokens=False)["input_ids"]
    finally:
        enc.close()
