"""End to end: a real `serve run deploy/ensemble.yaml` (Ray Serve, four specialists on CPU) and the
unmodified `openai` client. One server for the module; the tests that change policies run last.

Ray 2.60 specifics: the cluster runs with token auth (RAY_AUTH_MODE=token, as the README starts it; the
token is ~/.ray/auth_token, made on first use), and the CLI (`serve deploy`) gets the same mode. A
backgrounded `serve run` ignores SIGINT, so it is stopped with SIGTERM and the cluster cleaned up
with `ray stop --force`. The replica-death test kills cpp's replica and runs last.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import requests
import yaml

import serve_harness
from serve_harness import BASE, BIN, REPO, STARTUP_LIMIT_S, Server
from router.tools import parameters_of
from specialists.train.tools import tools_for

pytestmark = pytest.mark.slow

TOKEN = "e2e-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DOMAINS = ("cpp", "python", "build", "shell")
SPECIALISTS = (*DOMAINS, "general")  # general: SmolLM2-135M-Instruct (imported) + our drafter

QUESTIONS = {
    "cpp": "What does `std::vector::reserve` do in C++?",
    "python": "What does `json.dumps` do in Python?",
    "build": "What does the CMake module FindZLIB do?",
    "shell": "What is the `tar` command?",
    "general": "What is the capital of France? Answer in one sentence.",
}
TOOL_RESULTS = {
    "lookup_symbol": {"symbol": "std::vector::reserve", "header": "vector",
                      "declaration": "void reserve(size_type __n);", "doc": "Attempt to preallocate enough memory."},
    "compile_snippet": {"command": "g++ -std=c++17 -fsyntax-only snippet.cpp", "exit_status": 0, "diagnostics": ""},
    "run_python": "4",
    "pydoc": "Help on function dumps in json:\n\ndumps(obj, *, skipkeys=False, ...)\n    Serialize obj to a JSON formatted str.",
    "cmake_build": "[ 50%] Building C object CMakeFiles/app.dir/main.c.o\n[100%] Linking C executable app\n[100%] Built target app",
    "make_target": "cc -O2 -c main.c -o main.o\ncc main.o -o app",
    "cmake_help": "FindZLIB\n--------\n\nFind the native ZLIB includes and library.",
    "run_shell": "bin\netc\nusr",
    "man_page": "NAME\n    tar - an archiving utility\nSYNOPSIS\n    tar [OPTION...] [FILE]...",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    with serve_harness.running_server(tmp_path_factory.mktemp("serve"), TOKEN) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key="not-needed", max_retries=0, timeout=60)


def held_out_tool_conv(domain: str, tool: str) -> dict:
    for line in (REPO / "bench" / "data" / domain / "tool_convs.jsonl").read_text().splitlines():
        conv = json.loads(line)
        if conv["expected"]["name"] == tool:
            return conv
    raise LookupError(tool)


def admin_view(name: str) -> dict:
    r = requests.get(f"{BASE}/admin/policies/{name}", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def speculation_of(client: openai.OpenAI, model: str, max_tokens: int = 12, **kw) -> str:
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": QUESTIONS.get(model, "hello")}], max_tokens=max_tokens, **kw)
    raw.parse()
    return raw.headers["x-speculation"]


def wait_for_speculation(client: openai.OpenAI, model: str, want: str, within_s: float = 5.0) -> float:
    start = time.monotonic()
    while True:
        got = speculation_of(client, model)
        if got == want:
            return time.monotonic() - start
        assert time.monotonic() - start < within_s, f"{model}: x-speculation still {got!r}, wanted {want!r}"
        time.sleep(0.2)


# ---- serving -------------------------------------------------------------------------------------


def test_health_within_limit(server):
    assert server.startup_s < STARTUP_LIMIT_S
    r = requests.get(f"{BASE}/health", timeout=10)
    assert r.status_code == 200 and r.json()["specialists"] == {d: True for d in SPECIALISTS}


def test_models(client):
    assert {m.id for m in client.models.list()} == {"auto", *SPECIALISTS}


@pytest.mark.parametrize("model", [*SPECIALISTS, "auto"])
def test_chat_non_streaming_and_streaming(client, model):
    question = QUESTIONS.get(model, "What does `json.dumps` do in Python?")
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=48)
    reply = raw.parse()
    chosen = raw.headers["x-cantata-specialist"]
    assert chosen in SPECIALISTS and (model == "auto" or chosen == model) and reply.model == chosen
    assert 0.0 <= float(raw.headers["x-cantata-route-confidence"]) <= 1.0
    assert raw.headers["x-speculation"] in ("on", "off", "fallback")
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.choices[0].message.content
    assert reply.usage.completion_tokens <= 48

    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                            max_tokens=48, stream=True, stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert finish in ("stop", "length") and usage is not None and usage.completion_tokens <= 48
    if model != "auto":  # greedy: the stream says what the non-streamed reply said
        assert text == reply.choices[0].message.content


def test_auto_routes_by_content(client):
    for domain, question in QUESTIONS.items():
        raw = client.chat.completions.with_raw_response.create(
            model="auto", messages=[{"role": "user", "content": question}], max_tokens=4)
        raw.parse()
        assert raw.headers["x-cantata-specialist"] == domain, question


@pytest.mark.parametrize("model", ["general", "auto"])
def test_general_answers_usefully(client, model):
    """The pretrained general specialist answers a plain question correctly, pinned or routed."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": QUESTIONS["general"]}], max_tokens=32)
    reply = raw.parse()
    assert raw.headers["x-cantata-specialist"] == "general"
    assert "Paris" in reply.choices[0].message.content


@pytest.mark.parametrize("domain", DOMAINS)
def test_tool_round_trip_for_each_documented_tool(client, domain):
    for tool in tools_for(domain):
        name = tool["function"]["name"]
        conv = held_out_tool_conv(domain, name)
        msgs = list(conv["messages"])
        first = client.chat.completions.create(model=domain, messages=msgs, tools=conv["tools"], max_tokens=96,
                                               tool_choice={"type": "function", "function": {"name": name}})
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == name
        call = choice.message.tool_calls[0]
        assert isinstance(json.loads(call.function.arguments), dict)
        result = TOOL_RESULTS[name]
        msgs += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": result if isinstance(result, str) else json.dumps(result)}]
        answer = client.chat.completions.create(model=domain, messages=msgs, tools=conv["tools"], max_tokens=96)
        assert answer.choices[0].finish_reason in ("stop", "length"), (name, answer.choices[0].message)
        assert answer.choices[0].message.content, name


@pytest.mark.parametrize("domain", DOMAINS)
def test_required_and_named_always_call(client, domain):
    tools = tools_for(domain)
    names = [t["function"]["name"] for t in tools]
    for question in (QUESTIONS[domain], "Hello! How are you today?"):
        msgs = [{"role": "user", "content": question}]
        required = client.chat.completions.create(model=domain, messages=msgs, tools=tools, tool_choice="required", max_tokens=96)
        assert required.choices[0].finish_reason == "tool_calls" and required.choices[0].message.tool_calls[0].function.name in names
        for name in names:
            named = client.chat.completions.create(model=domain, messages=msgs, tools=tools, max_tokens=96,
                                                   tool_choice={"type": "function", "function": {"name": name}})
            assert [c.function.name for c in named.choices[0].message.tool_calls][:1] == [name]


@pytest.mark.parametrize("model", SPECIALISTS)
def test_constrained_tool_calls_and_json_are_valid(client, model):
    """Held-out BFCL schemas: a required call valid for its schema, response_format output that validates."""
    rows = [json.loads(x) for x in (REPO / "bench/data/tools/bfcl_heldout.jsonl").read_text().splitlines()][::20]
    for row in rows[:3 if model == "general" else 6]:
        schemas = {f["name"]: parameters_of(f.get("parameters")) for f in row["functions"]}
        call = client.chat.completions.create(model=model, messages=row["messages"], tool_choice="required", max_tokens=256,
                                              tools=[{"type": "function", "function": f} for f in row["functions"]])
        fn = call.choices[0].message.tool_calls[0].function
        jsonschema.validate(json.loads(fn.arguments), schemas[fn.name])
        schema = schemas[row["functions"][0]["name"]]
        reply = client.chat.completions.create(model=model, messages=row["messages"], max_tokens=256, response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {"a": {"not": {"const": "x"}}}}}}
    with pytest.raises(openai.BadRequestError, match="properties.a.not"):  # a keyword the grammar cannot enforce
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], response_format=bad)


def test_streamed_tool_call(client):
    conv = held_out_tool_conv("shell", "man_page")
    stream = client.chat.completions.create(model="shell", messages=conv["messages"], tools=conv["tools"],
                                            tool_choice="required", stream=True, max_tokens=96)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for tc in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            entry["name"] += (tc.function.name or "") if tc.function else ""
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert finish == "tool_calls" and calls[0]["id"] and calls[0]["name"] in ("man_page", "run_shell")
    assert isinstance(json.loads(calls[0]["arguments"]), dict)


def test_errors_reach_the_client_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="cpp", messages=[{"role": "user", "content": "x"}], n=2)
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="cpp", messages=[])


def test_one_x_request_id_per_response(client):
    """Serve's proxy sets x-request-id (the caller's, or a new one); the router adds none of its own."""
    chat = {"model": "shell", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for r in (requests.post(f"{BASE}/v1/chat/completions", json=chat, timeout=30),
              requests.post(f"{BASE}/v1/chat/completions", json={**chat, "stream": True}, timeout=30),
              requests.post(f"{BASE}/v1/chat/completions", json={**chat, "model": "nope"}, timeout=30),
              requests.get(f"{BASE}/v1/models", timeout=10)):
        assert len(r.raw.headers.getlist("x-request-id")) == 1, (r.status_code, r.raw.headers)
    mine = requests.post(f"{BASE}/v1/chat/completions", json=chat, headers={"x-request-id": "e2e-id-1"}, timeout=30)
    assert mine.raw.headers.getlist("x-request-id") == ["e2e-id-1"]


def test_one_trace_across_router_and_specialist(server, client):
    trace_id = "5b8aa5a2d2c872e8321cf37308d69df2"
    raw = client.chat.completions.with_raw_response.create(
        model="python", messages=[{"role": "user", "content": QUESTIONS["python"]}], max_tokens=16,
        extra_headers={"traceparent": f"00-{trace_id}-051581bf3cb55c13-01"})
    raw.parse()
    assert raw.headers["x-trace-id"] == trace_id
    deadline = time.monotonic() + 10
    while True:
        spans = [json.loads(line) for line in server.trace_file.read_text().splitlines() if trace_id in line]
        names = {s["name"]: s for s in spans}
        if {"POST /v1/chat/completions", "route", "specialist.generate", "decode"} <= set(names) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {s["component"] for s in spans} == {"router", "specialist:python"}
    assert names["POST /v1/chat/completions"]["parent_span_id"] == "051581bf3cb55c13"
    assert names["specialist.generate"]["parent_span_id"] == names["POST /v1/chat/completions"]["span_id"]
    assert names["decode"]["parent_span_id"] == names["specialist.generate"]["span_id"]
    assert names["decode"]["attributes"]["cantata.speculation"] == raw.headers["x-speculation"]
    assert {"cantata.drafted", "cantata.accepted", "cantata.mean_accepted_length", "cantata.rollbacks"} <= set(
        names["decode"]["attributes"])


# ---- live policies (these change the server's state; they run last) ------------------------------


def test_admin_needs_the_token(server):
    assert requests.get(f"{BASE}/admin/policies", timeout=10).status_code == 401
    assert requests.put(f"{BASE}/admin/policies/cpp", json={"mode": "off"}, timeout=10).status_code == 401
    assert requests.get(f"{BASE}/admin/policies", headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
    views = requests.get(f"{BASE}/admin/policies", headers=AUTH, timeout=10).json()["specialists"]
    assert set(views) == set(SPECIALISTS)


def test_speculation_flips_after_admin_put(client):
    pid = admin_view("cpp")["pid"]
    for mode in ("off", "on", "off", "on"):
        r = requests.put(f"{BASE}/admin/policies/cpp", json={"mode": mode}, headers=AUTH, timeout=10)
        assert r.status_code == 200 and r.json()["policy"]["mode"] == mode
        assert wait_for_speculation(client, "cpp", mode) < 5.0
    assert admin_view("cpp")["pid"] == pid  # the same replica: no restart


def test_auto_gating_falls_back_and_probes_again(client):
    """Crafted to reject (min_acceptance 1.0, sampled drafts; acceptance alone judges: a CPU gate
    takes a new policy's plain figure first): fallback, then on again after the cooldown."""
    policy = {"mode": "auto", "num_speculative_tokens": 3, "acceptance": "rejection", "auto": {
        "min_acceptance": 1.0, "window": 6, "max_running_batch": 8, "cooldown_s": 3.0, "min_speedup": 0.0}}
    assert requests.put(f"{BASE}/admin/policies/shell", json=policy, headers=AUTH, timeout=10).status_code == 200
    assert speculation_of(client, "shell", max_tokens=64, temperature=1.0, seed=7) == "fallback"
    assert (view := admin_view("shell"))["gate"]["status"] == "fallback" and view["step_times"]["fallback:low_acceptance"]["steps"] > 0
    deadline = time.monotonic() + 10
    while admin_view("shell")["speculation"] != "on":
        assert time.monotonic() < deadline, admin_view("shell")
        time.sleep(0.2)
    assert speculation_of(client, "shell", max_tokens=2) == "on"


def _deploy(server: Server, config: dict) -> None:
    path = server.workdir / "deploy.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run([str(BIN / "serve"), "deploy", str(path)], cwd=REPO, env=server.env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_speculation_flips_after_serve_deploy(server, client):
    config = yaml.safe_load((REPO / "deploy" / "ensemble.yaml").read_text())
    pids = {d: admin_view(d)["pid"] for d in SPECIALISTS}
    for mode in ("off", "on"):
        for dep in config["applications"][0]["deployments"]:
            if dep["name"] == "build":
                dep["user_config"]["speculation"]["mode"] = mode
        _deploy(server, config)
        assert wait_for_speculation(client, "build", mode) < 5.0
    assert {d: admin_view(d)["pid"] for d in SPECIALISTS} == pids  # reconfigured in place, no restarts


# ---- a replica's death (kill -9 of cpp's replica process; it restarts, so this runs last) -------------


def test_killed_replica_ends_every_stream_cleanly_and_comes_back(client):
    """Streams in flight end with [DONE] after their finishing chunk (done before the kill, or
    retried after the restart when no text had been sent) or after an SSE error event in OpenAI's
    shape; never a cut body. Non-streams get 200 (retried) or 503 + Retry-After. A request sent
    after the death is served once the replica is back; cpp serves again within 15 s."""
    old_pid = admin_view("cpp")["pid"]
    first_text = threading.Event()
    with ThreadPoolExecutor(16) as pool:
        streams = [pool.submit(serve_harness.stream, BASE, i, first_text) for i in range(6)]
        singles = [pool.submit(serve_harness.complete, BASE, 100 + i) for i in range(3)]
        assert first_text.wait(60), "no stream produced text"
        killed = serve_harness.kill_frozen(old_pid)
        back = pool.submit(serve_harness.wait_served, BASE, killed, 15.0)
        late = pool.submit(lambda: client.with_options(max_retries=6, timeout=60).chat.completions.with_raw_response
                           .create(model="cpp", messages=[{"role": "user", "content": QUESTIONS["cpp"]}], max_tokens=8))
        streamed = [f.result(timeout=180) for f in streams]
        answered = [f.result(timeout=180) for f in singles]
        back_s, late_raw = back.result(timeout=180), late.result(timeout=180)
    errored = 0
    for s in streamed:
        assert s.cut is None and len(s.request_ids) == 1, s
        if s.status == 503:  # never admitted, and the retry found no replica in time
            assert s.retry_after and s.body["error"]["type"] == "service_unavailable", s
            continue
        assert s.status == 200 and s.data[-1] == "[DONE]", s
        last = s.last_event()
        if "error" in last:  # cut after text reached the client
            errored += 1
            assert set(last["error"]) == {"message", "type", "param", "code"}
            assert (last["error"]["type"], last["error"]["code"]) == ("service_unavailable", "specialist_replica_died")
        else:
            assert last["choices"][0]["finish_reason"] in ("stop", "length"), s
    assert errored >= 1, "no stream was caught mid-body by the kill"
    retried = [s for s in streamed + answered if s.status == 200 and s.ended_at > killed]
    assert retried, "no in-flight request completed after the kill"
    for a in answered:
        assert a.cut is None and len(a.request_ids) == 1, a
        assert (a.status == 200 and a.body["choices"][0]["message"]["content"]) or (
            a.status == 503 and a.retry_after and a.body["error"]["code"] == "specialist_replica_died"), a
    assert late_raw.parse().choices[0].message.content and len(late_raw.headers.get_list("x-request-id")) == 1
    assert back_s < 15.0, f"cpp served again only after {back_s:.1f} s"
    assert admin_view("cpp")["pid"] != old_pid


def test_killed_router_answers_in_openai_shape(server):
    """With the proxy guard (router/proxy_guard.py), the requests a killed router was serving end in
    OpenAI's shape (a stream: an error event and [DONE]; a non-stream: 503 + Retry-After), not with
    the proxy's plain-text 500 or a cut body; a new router replica serves within 15 s."""
    pid = serve_harness.replica_pid(server, "router")
    first_text = threading.Event()
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(serve_harness.stream, BASE, 200 + i, first_text) for i in range(3)]
        single = pool.submit(serve_harness.complete, BASE, 300)
        assert first_text.wait(60), "no stream produced text"
        killed = serve_harness.kill_frozen(pid)
        back = pool.submit(serve_harness.wait_served, BASE, killed, 15.0)
        streamed, answered, back_s = [f.result(timeout=180) for f in streams], single.result(timeout=180), back.result(180)
    ends = []
    for s in streamed:
        assert s.cut is None and len(s.request_ids) == 1, s
        if s.status == 503:  # the router died before it answered
            assert s.retry_after == "5" and s.body["error"]["code"] == "router_unavailable", s
            continue
        assert s.status == 200 and s.data[-1] == "[DONE]", s
        ends.append(s.last_event().get("error", {}).get("code", "finished"))
    assert "router_unavailable" in ends and set(ends) <= {"router_unavailable", "finished"}, ends
    assert answered.cut is None and len(answered.request_ids) == 1, answered
    assert answered.status == 200 or (answered.status == 503 and answered.retry_after == "5" and
                                      answered.body["error"]["code"] == "router_unavailable"), answered
    assert back_s < 15.0 and serve_harness.replica_pid(server, "router") != pid
