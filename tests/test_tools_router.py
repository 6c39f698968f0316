"""Tools between OpenAI's API and the chat template: schema quirks, tool_choice, message mapping,
tool-call extraction and streaming deltas; then the same through the HTTP app with real specialists
(shell: Llama, cpp: Bamba), no Ray."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider

from router.api import BadRequestError, ChatCompletionRequest, ChatMessage, ToolDefinition
from router.backends import LocalBackend, local_specialists
from router.http import build_http_app
from router.routing import Router
from router.service import ChatService
from router.tool_stream import ToolCallStreamer
from router.tools import (
    extract_tool_calls,
    plan_tools,
    prompt_tools,
    sanitize_schema,
    to_template_messages,
)
from specialists.chat import format_tool_call, render, validate_arguments
from specialists.train.tools import tools_for

SHELL_TOOLS = tools_for("shell")


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "shell", "messages": [{"role": "user", "content": "hi"}], **kw})


# ---- schemas -------------------------------------------------------------------------------------


def test_trained_tool_schemas_render_unchanged():
    """The server's prompt for the documented tools is byte-identical to the training template's."""
    msgs = [{"role": "user", "content": "Show the man page of `tar`."}]
    for domain in ("cpp", "python", "build", "shell"):
        tools = tools_for(domain)
        ours = prompt_tools([ToolDefinition.model_validate(t) for t in tools])
        assert render(msgs, ours, add_generation_prompt=True) == render(msgs, tools, add_generation_prompt=True)


def test_dict_type_quirks_become_json_schema():
    quirky = {
        "type": "dict",
        "properties": {
            "path": {"type": "str", "required": True},
            "opts": {"type": "dict", "properties": {"depth": {"type": "int"}, "tags": {"type": "List[str]"}}},
            "mode": {"type": "string", "enum": ["fast", "slow"]},
            "ratio": {"type": "float"},
            "any": {"type": "any"},
        },
        "required": ["mode"],
    }
    fixed = sanitize_schema(quirky)
    assert fixed["type"] == "object"
    assert fixed["properties"]["opts"]["type"] == "object"
    assert fixed["properties"]["opts"]["properties"]["depth"]["type"] == "integer"
    assert fixed["properties"]["opts"]["properties"]["tags"]["type"] == "array"
    assert fixed["properties"]["ratio"]["type"] == "number"
    assert "type" not in fixed["properties"]["any"]
    assert set(fixed["required"]) == {"mode", "path"}
    assert "required" not in fixed["properties"]["path"]
    assert validate_arguments({"path": "/x", "mode": "fast", "opts": {"depth": 2, "tags": ["a"]}}, fixed) is None
    assert "enum" in validate_arguments({"path": "/x", "mode": "medium"}, fixed) or "not one of" in validate_arguments(
        {"path": "/x", "mode": "medium"}, fixed)
    assert validate_arguments({"mode": "fast"}, fixed) is not None  # path became required


def test_missing_parameters_and_extra_keys():
    tool = ToolDefinition.model_validate({"type": "function", "function": {"name": "ping", "strict": True,
                                                                          "x-vendor": {"a": 1}}})
    (rendered,) = prompt_tools([tool])
    assert rendered == {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
    bare = ToolDefinition.model_validate({"name": "ping", "parameters": json.dumps({"type": "object"})})
    assert bare.function.name == "ping" and bare.function.parameters == {"type": "object"}


@given(st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5)),
                    lambda kids: st.one_of(st.lists(kids, max_size=3),
                                           st.dictionaries(st.sampled_from(["type", "properties", "items", "required",
                                                                            "enum", "anyOf", "x"]), kids, max_size=4)),
                    max_leaves=12))
@settings(max_examples=150, deadline=None)
def test_sanitize_never_breaks_on_any_json(schema):
    fixed = sanitize_schema(schema)
    assert isinstance(fixed, dict)
    json.dumps(fixed)
    assert isinstance(validate_arguments({}, {"name": "f", "parameters": fixed}) or "", str)


# ---- tool_choice ---------------------------------------------------------------------------------


def test_tool_choice_plans():
    assert plan_tools(request()).prompt_tools is None
    auto = plan_tools(request(tools=SHELL_TOOLS))
    assert auto.parse_calls and not auto.forced and len(auto.prompt_tools) == 2
    # auto: the call's grammar waits for the model's <tool_call>, and offers every tool
    assert auto.grammar.kind == "tool_call" and auto.grammar.activate_on_tool_open
    assert [t.name for t in auto.grammar.tools] == [t["function"]["name"] for t in SHELL_TOOLS]
    none = plan_tools(request(tools=SHELL_TOOLS, tool_choice="none"))
    assert none.prompt_tools is None and not none.parse_calls and none.grammar is None
    required = plan_tools(request(tools=SHELL_TOOLS, tool_choice="required"))
    assert required.forced_prefix == "<tool_call>" and not required.grammar.activate_on_tool_open
    assert len(required.grammar.tools) == 2
    named = plan_tools(request(tools=SHELL_TOOLS, tool_choice={"type": "function", "function": {"name": "man_page"}}))
    assert named.forced_prefix == "<tool_call>" and [t.name for t in named.grammar.tools] == ["man_page"]
    with pytest.raises(BadRequestError):
        plan_tools(request(tools=SHELL_TOOLS, tool_choice={"type": "function", "function": {"name": "rm_rf"}}))
    with pytest.raises(BadRequestError):
        plan_tools(request(tool_choice="required"))
    with pytest.raises(BadRequestError):
        plan_tools(request(tools=SHELL_TOOLS + SHELL_TOOLS[:1]))


# ---- messages ------------------------------------------------------------------------------------


def test_openai_conversation_maps_onto_the_template():
    msgs = [
        ChatMessage(role="developer", content="Be brief."),
        ChatMessage(role="user", content=[{"type": "text", "text": "Show "}, {"type": "text", "text": "tar."}]),
        ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "man_page", "arguments": '{"name":"tar"}'}}]}),
        ChatMessage(role="tool", tool_call_id="call_1", content="TAR(1)"),
    ]
    text = render(to_template_messages(msgs), SHELL_TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call these tools:")
    assert "<|im_start|>user\nShow tar.<|im_end|>" in text
    # arguments re-serialized to the trained form, whatever spacing the client sent
    assert f"<|im_start|>assistant\n{format_tool_call('man_page', {'name': 'tar'})}<|im_end|>" in text
    assert text.endswith("<|im_start|>tool\n<tool_response>TAR(1)</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_non_text_content_is_refused():
    with pytest.raises(BadRequestError) as err:
        to_template_messages([ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}])])
    assert err.value.param == "messages[0].content[0]"


# ---- calls in the output -------------------------------------------------------------------------


def test_extract_valid_invalid_and_unknown_calls():
    plan = plan_tools(request(tools=SHELL_TOOLS))
    text = ('Sure.\n<tool_call>{"name": "man_page", "arguments": {"name": "tar", "section": 1}}</tool_call>'
            '<tool_call>{"name": "man_page", "arguments": {"section": 12}}</tool_call>'
            '<tool_call>{"name": "reboot", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "run_shell", "arguments": {"command": "ls"</tool_call>')
    got = extract_tool_calls(text, plan)
    assert got.content == "Sure."
    assert [c.function.name for c in got.calls] == ["man_page", "man_page", "reboot", "run_shell"]
    assert json.loads(got.calls[0].function.arguments) == {"name": "tar", "section": 1}
    errors = {e.index: e.error for e in got.errors}
    assert 0 not in errors
    assert "schema" in errors[1] and "unknown tool" in errors[2] and "JSON" in errors[3]
    assert got.calls[3].function.arguments.startswith('{"command": "ls"')
    assert len({c.id for c in got.calls}) == 4


def test_single_call_when_parallel_calls_are_off():
    plan = plan_tools(request(tools=SHELL_TOOLS, parallel_tool_calls=False))
    text = format_tool_call("man_page", {"name": "a"}) + format_tool_call("man_page", {"name": "b"})
    assert [json.loads(c.function.arguments)["name"] for c in extract_tool_calls(text, plan).calls] == ["a"]


def _assemble(deltas):
    content, calls = "", {}
    for d in deltas:
        content += d.content or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            entry["name"] = tc.function.name or entry["name"]
            entry["arguments"] += tc.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)]


REPLIES = [
    "plain text only",
    format_tool_call("man_page", {"name": "tar"}),
    "Let me look.\n" + format_tool_call("run_shell", {"command": "ls <dir>"}) + format_tool_call("man_page", {"name": "ls"}),
    '<tool_call>{"name": "run_shell", "arguments": {"command": "ls"',  # unterminated
    # the close tag inside a JSON string (plain text to a tokenizer without the token) does not end the call
    '<tool_call>{"name": "run_shell", "arguments": {"command": "echo }}</tool_call> done"}}</tool_call> after',
    "a < b and <tool_ but no call",
]


@given(st.sampled_from(REPLIES), st.lists(st.integers(1, 7), min_size=1, max_size=40))
@settings(max_examples=200, deadline=None)
def test_streamed_deltas_equal_the_whole_reply(reply, cuts):
    plan = plan_tools(request(tools=SHELL_TOOLS))
    streamer = ToolCallStreamer(plan)
    deltas, pos, i = [], 0, 0
    while pos < len(reply):
        step = cuts[i % len(cuts)]
        deltas += streamer.feed(reply[pos: pos + step])
        pos, i = pos + step, i + 1
    deltas += streamer.finish()
    content, calls = _assemble(deltas)
    whole = extract_tool_calls(reply, plan)
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments) for c in whole.calls]
    assert content.strip() == (whole.content or "")
    assert [e.error for e in streamer.errors] == [e.error for e in whole.errors]
    assert all("<tool_call>" not in (d.content or "") for d in deltas)


def test_a_close_tag_inside_a_json_string_does_not_end_the_call():
    plan = plan_tools(request(tools=SHELL_TOOLS))
    got = extract_tool_calls('<tool_call>{"name": "run_shell", "arguments": {"command": "echo }}</tool_call>"}}</tool_call>',
                             plan)
    assert json.loads(got.calls[0].function.arguments) == {"command": "echo }}</tool_call>"} and not got.errors


# ---- over HTTP, real specialists -----------------------------------------------------------------


@pytest.fixture(scope="module")
def client():
    provider = TracerProvider()
    specs = local_specialists(["shell", "cpp"], "deploy/models", tracer_provider=provider)
    service = ChatService({n: LocalBackend(s) for n, s in specs.items()}, Router(list(specs), None, "shell"), provider)
    with TestClient(build_http_app(service)) as c:
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "specialists did not warm up"
            time.sleep(0.05)
        yield c
    for s in specs.values():
        s.shutdown()


def chat(client, **body):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r


def stream_deltas(client, **body):
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    return r, events


PROMPTS = {"shell": ["Show the man page of `tar`.", "Can you run `whatis less` for me?", "What is in /etc?"],
           "cpp": ["Find the declaration of std::vector::reserve.", "Does `int main(){}` compile as C++17?",
                   "What is a lambda?"]}


@pytest.mark.parametrize("domain", ["shell", "cpp"])
def test_required_and_named_always_call(client, domain):
    tools = tools_for(domain)
    for prompt in PROMPTS[domain]:
        msgs = [{"role": "user", "content": prompt}]
        body = chat(client, model=domain, messages=msgs, tools=tools, tool_choice="required", max_tokens=64).json()
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"], body
        for tool in tools:
            name = tool["function"]["name"]
            choice = chat(client, model=domain, messages=msgs, tools=tools, max_tokens=64,
                          tool_choice={"type": "function", "function": {"name": name}}).json()["choices"][0]
            assert choice["finish_reason"] == "tool_calls"
            assert choice["message"]["tool_calls"][0]["function"]["name"] == name


def test_tool_round_trip_and_none(client):
    msgs = [{"role": "user", "content": "Show the man page of `tar`."}]
    first = chat(client, model="shell", messages=msgs, tools=SHELL_TOOLS).json()["choices"][0]
    assert first["finish_reason"] == "tool_calls"
    call = first["message"]["tool_calls"][0]
    assert call["function"]["name"] == "man_page" and json.loads(call["function"]["arguments"])["name"] == "tar"
    assert "tool_call_errors" not in first["message"]
    msgs += [first["message"], {"role": "tool", "tool_call_id": call["id"],
                                "content": "TAR(1)\nNAME\n  tar - an archiving utility\nSYNOPSIS\n  tar [OPTION...] [FILE]..."}]
    second = chat(client, model="shell", messages=msgs, tools=SHELL_TOOLS).json()["choices"][0]
    assert second["finish_reason"] == "stop" and "tool_calls" not in second["message"]
    assert "tar" in second["message"]["content"]
    plain = chat(client, model="shell", messages=msgs[:1], tools=SHELL_TOOLS, tool_choice="none", max_tokens=48).json()
    assert "tool_calls" not in plain["choices"][0]["message"]


def test_streamed_tool_call_matches_non_streamed(client):
    body = {"model": "cpp", "messages": [{"role": "user", "content": PROMPTS["cpp"][0]}], "tools": tools_for("cpp"),
            "tool_choice": "required", "max_tokens": 64}
    whole = chat(client, **body).json()["choices"][0]
    r, events = stream_deltas(client, **body)
    assert r.headers["x-cantata-specialist"] == "cpp"
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == whole["message"]["tool_calls"][0]["function"]["name"]
    assert "".join(c["function"].get("arguments", "") for c in calls) == whole["message"]["tool_calls"][0]["function"]["arguments"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_schema_invalid_arguments_are_reported(client):
    """A non-strict tool whose schema uses a keyword the grammar cannot enforce (uniqueItems): the
    grammar drops it, forces the only call its other keywords allow ([7, 7]), and the call comes back
    with the validation error beside it."""
    strict = [{"type": "function", "function": {"name": "man_page", "description": "Show a manual page.",
                                                 "parameters": {"type": "dict", "properties": {
                                                     "sections": {"type": "array", "items": {"enum": [7]}, "minItems": 2,
                                                                  "maxItems": 2, "uniqueItems": True}},
                                                     "required": ["sections"]}}}]
    msg = chat(client, model="shell", messages=[{"role": "user", "content": "Show the man page of `tar`."}],
               tools=strict, tool_choice="required").json()["choices"][0]["message"]
    assert msg["tool_calls"][0]["function"]["name"] == "man_page"
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"sections": [7, 7]}
    assert msg["tool_call_errors"] and "schema" in msg["tool_call_errors"][0]["error"]
