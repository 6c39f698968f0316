"""Tools between OpenAI's API and the chat template: schemas, tool_choice, message mapping and tool-call
extraction from generated text (streaming tool-call deltas: router/tool_stream.py).

* `prompt_tools` gives the tool list the template renders: the function's name, description and a
  repaired parameters schema (`"type": "dict"` and friends become JSON-schema types, a missing
  schema becomes an empty object schema, keys the template never saw in training are dropped).
* `plan_tools` turns `tools` + `tool_choice` into a `ToolPlan`: which tools go into the prompt,
  which forced prefix ends the prompt (`required` or a named function: `<tool_call>`), the grammar
  the call follows (specialists/grammar.py: an offered name, arguments valid for its schema; with
  `auto` it starts once the model writes `<tool_call>`), and whether output is parsed for calls.
* `response_grammar` turns `response_format` (`json_object`, `json_schema`) into a grammar.
* `to_template_messages` maps OpenAI messages (assistant `tool_calls`, `role: "tool"` results,
  content parts, `developer`) onto what `specialists.chat.render` expects.
* `extract_tool_calls` (whole reply) and `tool_stream.ToolCallStreamer` (deltas) share `convert_call`, so a
  streamed reply and a non-streamed one report the same calls and the same argument errors.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.api import (
    BadRequestError,
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
    ResponseFunctionCall,
    ResponseToolCall,
    ToolCallError,
    ToolDefinition,
    tool_call_id,
)
from router.limits import RequestLimits
from router.schema_guard import check_schema, without_unsupported
from specialists.chat import TOOL_CALL_OPEN, ParsedToolCall, parse_tool_calls, validate_arguments
from specialists.wire import GrammarSpec, ToolGrammar

# ---- schemas -------------------------------------------------------------------------------------

_TYPE_ALIASES = {
    "dict": "object", "map": "object", "obj": "object",
    "list": "array", "tuple": "array", "set": "array",
    "str": "string", "text": "string",
    "int": "integer", "long": "integer",
    "float": "number", "double": "number", "decimal": "number",
    "bool": "boolean",
    "none": "null", "nonetype": "null",
    "any": None,  # no constraint
}
_JSON_TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalProperties", "not", "contains", "if", "then", "else")


def _fix_type(t: Any) -> Any:
    """A JSON-schema type from a type name real clients send ("dict", "int", "List", ...)."""
    if isinstance(t, list):
        fixed = [_fix_type(x) for x in t]
        return [x for x in fixed if x is not None] or None
    if not isinstance(t, str):
        return None
    low = t.strip().lower()
    if low in _JSON_TYPES:
        return low
    return _TYPE_ALIASES.get(low.split("[")[0], None)


def sanitize_schema(schema: Any, depth: int = 0) -> dict[str, Any]:
    """Repair a JSON schema from a real client so the template and `jsonschema` both accept it.

    Type names are mapped to JSON-schema types (unknown ones dropped); a property-level
    `"required": true` (an old convention) moves into the parent's `required` list; nested
    properties, items and combinators are repaired recursively; non-dict input becomes `{}`.
    """
    if not isinstance(schema, Mapping) or depth > 32:
        return {}
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type":
            fixed = _fix_type(value)
            if fixed is not None:
                out["type"] = fixed
        elif key in _SCHEMA_MAPS and isinstance(value, Mapping):
            out[key] = {str(k): sanitize_schema(v, depth + 1) for k, v in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [sanitize_schema(v, depth + 1) for v in value]
        elif key in _SCHEMA_ONES:
            if isinstance(value, bool) and key == "additionalProperties":
                out[key] = value
            elif isinstance(value, list) and key == "items":  # draft-4 tuple form
                out["prefixItems"] = [sanitize_schema(v, depth + 1) for v in value]
            elif isinstance(value, Mapping):
                out[key] = sanitize_schema(value, depth + 1)
        elif key == "required":
            if isinstance(value, list):
                out[key] = [str(v) for v in value if isinstance(v, str)]
        elif key == "enum":
            if isinstance(value, list) and value:
                out[key] = value
        else:
            out[key] = value
    props = out.get("properties")
    if isinstance(props, dict):
        flagged = [k for k, v in schema.get("properties", {}).items()
                   if isinstance(v, Mapping) and v.get("required") is True]
        if flagged:
            out["required"] = list(dict.fromkeys([*out.get("required", []), *flagged]))
        out.setdefault("type", "object")
    if "required" in out and isinstance(props, dict) and out.get("additionalProperties") is False:
        out["required"] = [r for r in out["required"] if r in props]
    return out


def parameters_of(fn_parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    """The repaired parameters schema of one function (an empty object schema when missing)."""
    schema = sanitize_schema(fn_parameters or {})
    if not schema:
        return {"type": "object", "properties": {}}
    if "type" not in schema and not any(k in schema for k in _SCHEMA_LISTS):
        schema = {"type": "object", **schema}
    return schema


def prompt_tool(tool: ToolDefinition) -> dict[str, Any]:
    """One tool as the template renders it (only the keys it was trained on)."""
    fn: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description:
        fn["description"] = tool.function.description
    fn["parameters"] = parameters_of(tool.function.parameters)
    return {"type": "function", "function": fn}


def prompt_tools(tools: Sequence[ToolDefinition]) -> list[dict[str, Any]]:
    return [prompt_tool(t) for t in tools]


# ---- tool_choice ---------------------------------------------------------------------------------


@dataclass
class ToolPlan:
    """What a request's tools and tool_choice mean for the prompt and for the reply."""

    prompt_tools: list[dict[str, Any]] | None  # rendered in the system turn (None: no tools)
    forced_prefix: str = ""  # appended to the prompt and prepended to the output
    parse_calls: bool = False  # look for <tool_call> blocks in the output
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> repaired parameters
    parallel: bool = True  # False: keep the first call only
    grammar: GrammarSpec | None = None  # what a call must follow (None: no tools)

    @property
    def forced(self) -> bool:
        return bool(self.forced_prefix)


def plan_tools(request: ChatCompletionRequest) -> ToolPlan:
    tools = request.tools or []
    choice = request.tool_choice
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise BadRequestError("tool names must be unique", param="tools")
    if not tools:
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise BadRequestError("tool_choice requires tools", param="tool_choice")
        return ToolPlan(prompt_tools=None)
    if choice == "none":
        return ToolPlan(prompt_tools=None)
    rendered = prompt_tools(tools)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in rendered}
    strict = {t.function.name: bool(t.function.strict) for t in tools}
    parallel = request.parallel_tool_calls is not False

    def grammar(offered: list[str], on_open: bool) -> GrammarSpec:
        # a strict function's schema was checked whole (router/schema_guard.py); a non-strict one's
        # grammar drops what it cannot enforce
        return GrammarSpec(kind="tool_call", activate_on_tool_open=on_open, tools=[
            ToolGrammar(name=n, parameters=schemas[n] if strict[n] else without_unsupported(schemas[n]), strict=strict[n])
            for n in offered])

    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in schemas:
            raise BadRequestError(f"tool_choice names {name!r}, which is not among the tools {names}",
                                  param="tool_choice")
        return ToolPlan(rendered, TOOL_CALL_OPEN, True, schemas, parallel, grammar([name], False))
    if choice == "required":
        return ToolPlan(rendered, TOOL_CALL_OPEN, True, schemas, parallel, grammar(names, False))
    return ToolPlan(rendered, "", True, schemas, parallel, grammar(names, True))


_FORMAT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def response_grammar(request: ChatCompletionRequest, limits: RequestLimits) -> GrammarSpec | None:
    """`response_format` as a grammar (None for text); a 400 naming what is wrong or unsupported."""
    fmt = request.response_format
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec(kind="json_object")
    if kind != "json_schema":
        raise BadRequestError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                              param="response_format", code="unsupported_parameter")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise BadRequestError("response_format json_schema needs a json_schema object", param="response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _FORMAT_NAME.fullmatch(name):
        raise BadRequestError("response_format.json_schema.name must be 1-64 letters, digits, _ or -",
                              param="response_format.json_schema.name")
    schema = spec.get("schema")
    if schema is None:
        return GrammarSpec(kind="json_object")
    if not isinstance(schema, dict):
        raise BadRequestError("response_format.json_schema.schema must be a JSON object", param="response_format.json_schema.schema")
    check_schema(schema, "response_format.json_schema.schema", limits, grammar=True)
    return GrammarSpec(kind="json_schema", schema=schema)


# ---- messages ------------------------------------------------------------------------------------

_TEXT_PARTS = ("text", "input_text", "output_text")


def content_text(content: str | list[dict[str, Any]] | None, param: str) -> str:
    """A message's text: a string, None, or text content parts (other parts are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise BadRequestError(f"content part type {kind!r} is not supported (text only)", param=f"{param}[{i}]")
    return "".join(texts)


def _call_arguments(arguments: str | dict[str, Any] | None) -> dict[str, Any] | str:
    """Arguments of an assistant tool call for the template: the parsed object when it is JSON (so
    it renders in the trained form), else the text as given."""
    if arguments is None:
        return {}
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def to_template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages -> the chat template's messages (roles system/user/assistant/tool)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        text = content_text(m.content, f"messages[{i}].content")
        if m.role in ("system", "developer"):
            out.append({"role": "system", "content": text})
        elif m.role == "user":
            out.append({"role": "user", "content": text})
        elif m.role in ("tool", "function"):
            out.append({"role": "tool", "content": text})
        else:
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if m.tool_calls:
                msg["tool_calls"] = [
                    {"type": "function",
                     "function": {"name": c.function.name, "arguments": _call_arguments(c.function.arguments)}}
                    for c in m.tool_calls
                ]
            out.append(msg)
    return out


# ---- calls in the output -------------------------------------------------------------------------

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"arguments"\s*:\s*(.*)$', re.S)


def _recover(raw: str) -> tuple[str | None, str]:
    """Name and argument text of a call whose JSON did not parse (best effort)."""
    m = _NAME.search(raw)
    name = None
    if m:
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            name = m.group(1)
    a = _ARGS.search(raw)
    args = a.group(1).strip() if a else ""
    if args.endswith("}") and args.count("{") < args.count("}"):
        args = args[:-1].rstrip()
    return name, args


def convert_call(parsed: ParsedToolCall, plan: ToolPlan, index: int) -> tuple[ResponseToolCall | None, ToolCallError | None]:
    """One parsed <tool_call> block -> an OpenAI tool call and/or the error that goes with it.

    A call with a name is always returned (its arguments as the model wrote them); arguments that
    are not a JSON object, or that do not satisfy the tool's schema, and names that were not
    offered, come back as a ToolCallError beside it. A block without a name is an error only.
    """
    if parsed.ok and parsed.name is not None and parsed.arguments is not None:
        call = ResponseToolCall(id=tool_call_id(), function=ResponseFunctionCall(
            name=parsed.name, arguments=json.dumps(parsed.arguments, ensure_ascii=False)))
        if parsed.name not in plan.schemas:
            return call, ToolCallError(index=index, name=parsed.name, raw=parsed.raw,
                                       error=f"unknown tool {parsed.name!r}; offered: {sorted(plan.schemas)}")
        problem = validate_arguments(parsed.arguments, plan.schemas[parsed.name])
        err = None if problem is None else ToolCallError(index=index, name=parsed.name, raw=parsed.raw,
                                                         error=f"arguments do not match the schema: {problem}")
        return call, err
    name = parsed.name
    args_text = ""
    if name is None:
        name, args_text = _recover(parsed.raw)
    error = parsed.error or "invalid tool call"
    if not name:
        return None, ToolCallError(index=-1, name=None, raw=parsed.raw, error=error)
    call = ResponseToolCall(id=tool_call_id(), function=ResponseFunctionCall(name=name, arguments=args_text))
    return call, ToolCallError(index=index, name=name, raw=parsed.raw, error=error)


@dataclass
class ExtractedCalls:
    content: str | None
    calls: list[ResponseToolCall]
    errors: list[ToolCallError]


async def extract_tool_calls_off_loop(text: str, plan: ToolPlan) -> ExtractedCalls:
    """`extract_tool_calls` in a worker thread when calls are validated against client schemas
    (bounded, but not instant: specialists/json_schema.py), so the event loop never waits on one."""
    if plan.parse_calls and plan.schemas and TOOL_CALL_OPEN in text:
        return await asyncio.to_thread(extract_tool_calls, text, plan)
    return extract_tool_calls(text, plan)


def extract_tool_calls(text: str, plan: ToolPlan) -> ExtractedCalls:
    """A whole reply (forced prefix included) -> content, tool calls and argument errors."""
    if not plan.parse_calls:
        return ExtractedCalls(text, [], [])
    content, parsed = parse_tool_calls(text)
    calls: list[ResponseToolCall] = []
    errors: list[ToolCallError] = []
    for p in parsed:
        if calls and not plan.parallel:
            break
        call, err = convert_call(p, plan, len(calls))
        if err is not None:
            errors.append(err)
        if call is not None:
            calls.append(call)
    return ExtractedCalls(content or (None if calls else ""), calls, errors)
