"""Cantata's chat template and tool-call syntax, shared by training and the server.

Conversations are rendered ChatML style::

    <|im_start|>system
    {system text}

    You can call these tools:
    <tools>
    {"name": "...", "description": "...", "parameters": {...}}
    </tools>
    To call a tool, reply with <tool_call>{"name": <tool name>, "arguments": <JSON object>}</tool_call><|im_end|>
    <|im_start|>user
    {content}<|im_end|>
    <|im_start|>assistant
    {content}<tool_call>{"name": "run_shell", "arguments": {"command": "ls"}}</tool_call><|im_end|>
    <|im_start|>tool
    <tool_response>{result}</tool_response><|im_end|>
    <|im_start|>assistant

`CHAT_TEMPLATE` is the same logic as a Jinja string for Hugging Face tokenizers (stored in
tokenizer_config.json); `render` evaluates it exactly the way `apply_chat_template` does.
`parse_tool_calls` splits generated assistant text back into content and tool calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping, Sequence

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<tools>",
    "</tools>",
)
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"  # end of turn
IM_START = "<|im_start|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"

TOOLS_INTRO = "You can call these tools:"
TOOLS_OUTRO = 'To call a tool, reply with <tool_call>{"name": <tool name>, "arguments": <JSON object>}</tool_call>'

# Whitespace is controlled explicitly with `-` so the output does not depend on trim_blocks/lstrip_blocks
# (Hugging Face enables both; `render` does the same).
CHAT_TEMPLATE = (
    "{%- macro text(c) -%}"
    "{%- if c is string -%}{{- c -}}"
    "{%- elif c is none -%}"
    "{%- elif c is mapping -%}{{- c | tojson -}}"
    "{%- else -%}{%- for p in c -%}{%- if p is mapping and p['type'] == 'text' -%}{{- p['text'] -}}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set has_system = messages | length > 0 and messages[0]['role'] == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if has_system -%}{{- text(messages[0]['content']) + '\\n\\n' -}}{%- endif -%}"
    "{{- '" + TOOLS_INTRO + "\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}"
    "{%- if tool['function'] is defined -%}{{- tool['function'] | tojson -}}{%- else -%}{{- tool | tojson -}}{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{{- '</tools>\\n" + TOOLS_OUTRO + "<|im_end|>\\n' -}}"
    "{%- elif has_system -%}"
    "{{- '<|im_start|>system\\n' + text(messages[0]['content']) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + text(message['content']) -}}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set f = call['function'] if call['function'] is defined else call -%}"
    "{%- if text(message['content']) or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>{\"name\": ' + (f['name'] | tojson) + ', \"arguments\": ' -}}"
    "{%- if f['arguments'] is string -%}{{- f['arguments'] -}}"
    "{%- elif f['arguments'] is defined and f['arguments'] is not none -%}{{- f['arguments'] | tojson -}}"
    "{%- else -%}{{- '{}' -}}{%- endif -%}"
    "{{- '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>tool\\n<tool_response>' + text(message['content']) + '</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text(message['content']) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """The `tojson` filter exactly as transformers defines it (no HTML escaping)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=4)
def _compiled(template: str):  # noqa: ANN202 - jinja2.Template
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """Deep-copy into plain JSON types, as transformers does before rendering."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def render(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
           add_generation_prompt: bool = False, template: str = CHAT_TEMPLATE) -> str:
    """Render a conversation with the chat template (same text as `tokenizer.apply_chat_template(tokenize=False)`)."""
    return _compiled(template).render(
        messages=_plain(list(messages)),
        tools=_plain(list(tools)) if tools is not None else None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
    )


def tool_function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The function dict of a tool given as {"type": "function", "function": {...}} or bare."""
    fn = tool.get("function")
    return fn if isinstance(fn, Mapping) else tool


def tool_name(tool: Mapping[str, Any]) -> str:
    return str(tool_function(tool).get("name", ""))


def format_tool_call(name: str, arguments: Mapping[str, Any] | str) -> str:
    """One tool call as the template renders it."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{TOOL_CALL_OPEN}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}{TOOL_CALL_CLOSE}'


@dataclass
class ParsedToolCall:
    """One `<tool_call>...</tool_call>` block from assistant output."""

    name: str | None
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


_END_MARKERS = (EOS_TOKEN, PAD_TOKEN)
_DECODER = json.JSONDecoder()
_SPACE = " \t\r\n"  # JSON's whitespace


def call_end(text: str, body_start: int, final: bool = True) -> int:
    """Index of the `</tool_call>` that closes the call whose body starts at `body_start`, or -1. A
    body that is a JSON object is read whole first, so a `</tool_call>` inside one of its strings
    (plain text to a tokenizer without that token) does not end the call. Otherwise the first
    `</tool_call>`; while the text is still arriving (`final` False) an object that does not parse yet
    waits for more."""
    i = body_start
    while i < len(text) and text[i] in _SPACE:
        i += 1
    if i < len(text) and text[i] == "{":
        try:
            _, j = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError):
            if not final:
                return -1
        else:  # the close after the object, not one inside it
            return text.find(TOOL_CALL_CLOSE, j)
    return text.find(TOOL_CALL_CLOSE, body_start)


def _parse_one(raw: str) -> ParsedToolCall:
    body = raw.strip()
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return ParsedToolCall(None, None, raw, f"invalid JSON: {exc}")
    if not isinstance(obj, dict):
        return ParsedToolCall(None, None, raw, "tool call is not a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParsedToolCall(None, None, raw, "missing name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return ParsedToolCall(name, None, raw, "arguments not an object")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ParsedToolCall(name, None, raw, "arguments not an object")
    return ParsedToolCall(name, args, raw, None)


def parse_tool_calls(text: str) -> tuple[str, list[ParsedToolCall]]:
    """Split assistant output into its plain content and its tool calls. Never raises.

    Text after a final `<|im_end|>` is dropped; an opening `<tool_call>` with no closing tag yields
    a call with error "unterminated tool call" holding the rest of the text as `raw`.
    """
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    for marker in _END_MARKERS:
        cut = text.find(marker)
        if cut >= 0:
            text = text[:cut]
    content: list[str] = []
    calls: list[ParsedToolCall] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            content.append(text[pos:])
            break
        content.append(text[pos:start])
        body_start = start + len(TOOL_CALL_OPEN)
        end = call_end(text, body_start)
        nested = text.find(TOOL_CALL_OPEN, body_start)
        if end < 0 or (0 <= nested < end):
            stop = nested if 0 <= nested and (end < 0 or nested < end) else len(text)
            calls.append(ParsedToolCall(None, None, text[body_start:stop], "unterminated tool call"))
            pos = stop
            if stop >= len(text):
                break
            continue
        calls.append(_parse_one(text[body_start:end]))
        pos = end + len(TOOL_CALL_CLOSE)
    plain = "".join(content).replace(TOOL_CALL_CLOSE, "")
    plain = re.sub(r"\n{3,}", "\n\n", plain).strip()
    return plain, calls


def parameters_schema(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """The JSON schema of a tool's arguments, from a tool, a function dict or the schema itself."""
    fn = tool_function(schema)
    if "name" in fn and isinstance(fn.get("parameters"), Mapping):
        return fn["parameters"]
    if "name" in fn and "parameters" not in fn:
        return {"type": "object"}
    return schema


def validate_arguments(arguments: Any, schema: Mapping[str, Any]) -> str | None:
    """Check tool-call arguments against a tool's schema; return an error message or None if valid.

    The schema is untrusted data (specialists/json_schema.py): only references inside it resolve,
    nothing is fetched or read, and patterns and references run under a time budget."""
    import jsonschema

    from specialists.json_schema import SchemaBudgetExceeded, validate_with_budget

    if arguments is None:
        return "arguments missing"
    params = parameters_schema(schema)
    try:
        return validate_with_budget(arguments, params)
    except jsonschema.exceptions.SchemaError as exc:
        return f"invalid schema: {exc.message}"
    except SchemaBudgetExceeded as exc:
        return f"validation gave up: {exc}"
    except jsonschema.exceptions._WrappedReferencingError as exc:  # noqa: SLF001 - no public name for it
        return f"invalid schema: unresolvable reference {str(exc.__cause__ or exc)[:200]}"
    except RecursionError:
        return "invalid schema: its references recurse without end"
    except Exception as exc:  # noqa: BLE001 - validation must never crash the caller
        return f"validation failed: {type(exc).__name__}"
