"""Tool schemas are data: limits checked when a request arrives, before anything renders or
validates against them.

* at most `max_tools` tools;
* one tool's `parameters`, as compact JSON, at most `max_schema_bytes`, nested at most
  `max_schema_depth` objects/arrays deep;
* every `$ref` / `$dynamicRef` / `$recursiveRef` points inside the schema (`#/...`): a reference
  to a file or a URL is refused by name (validation would refuse to follow it anyway, see
  specialists/json_schema.py; refusing here tells the client at once).

Each breach is a 400 in OpenAI's shape naming the tool (`param: tools[i].function.parameters`).

Constrained decoding (specialists/grammar.py, xgrammar) enforces most of JSON Schema but not every
keyword. `unsupported_keywords` names the ones it would not enforce (`not`, `if`/`then`/`else`,
`allOf`, `uniqueItems`, `dependentRequired`, ...): a `response_format` json_schema or a `strict`
function that uses one is refused with a 400 naming them; a non-strict function's schema loses them
for the grammar (`without_unsupported`: best effort, as OpenAI's non-strict calls), keeping them
for the prompt and for validation. Unknown keywords are annotations, as JSON Schema says.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from router.api import BadRequestError, ToolDefinition
from router.limits import RequestLimits
from specialists.json_schema import outside_references


# keywords the grammar would not enforce (xgrammar 0.2.8, checked one by one)
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "allOf", "uniqueItems", "dependentRequired", "dependentSchemas", "dependencies",
    "unevaluatedItems", "unevaluatedProperties", "minContains", "maxContains", "$dynamicRef", "$recursiveRef",
    "$dynamicAnchor", "$recursiveAnchor",
})
_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUB_ONES = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames",
             "unevaluatedProperties", "unevaluatedItems")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _subschemas(node: dict[str, Any], path: str) -> list[tuple[Any, str]]:
    out: list[tuple[Any, str]] = []
    for key in _SUB_MAPS:
        if isinstance(node.get(key), dict):
            out += [(v, f"{path}.{key}.{k}" if path else f"{key}.{k}") for k, v in node[key].items()]
    for key in _SUB_ONES:
        if isinstance(node.get(key), dict):
            out.append((node[key], f"{path}.{key}" if path else key))
    for key in _SUB_LISTS:
        if isinstance(node.get(key), list):
            out += [(v, f"{path}.{key}[{i}]" if path else f"{key}[{i}]") for i, v in enumerate(node[key])]
    return out


def unsupported_keywords(schema: Any) -> list[str]:
    """Paths of the keywords in `schema` the grammar would not enforce ("properties.x.not", ...)."""
    found: list[str] = []
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        found += [f"{path}.{k}" if path else k for k in node if k in UNSUPPORTED_KEYWORDS]
        stack.extend(_subschemas(node, path))
    return sorted(found)


def without_unsupported(schema: Any) -> Any:
    """A copy of `schema` without the keywords the grammar would not enforce (and their subschemas)."""
    if isinstance(schema, list):
        return [without_unsupported(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in UNSUPPORTED_KEYWORDS:
            continue
        if key in _SUB_MAPS and isinstance(value, dict):
            out[key] = {k: without_unsupported(v) for k, v in value.items()}
        elif key in _SUB_ONES or key in _SUB_LISTS:
            out[key] = without_unsupported(value)
        else:
            out[key] = value
    return out


def check_schema(schema: Any, where: str, limits: RequestLimits, *, grammar: bool) -> None:
    """Depth, size and references of one client schema; with `grammar`, also the keywords the grammar
    cannot enforce. A 400 naming `where` for the first breach."""
    depth = schema_depth(schema, limits.max_schema_depth)
    if depth > limits.max_schema_depth:
        raise BadRequestError(f"{where} is nested deeper than {limits.max_schema_depth} levels", param=where,
                              code="schema_too_deep")
    size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False, default=str))
    if size > limits.max_schema_bytes:
        raise BadRequestError(f"{where} is {size} characters as JSON; the limit is {limits.max_schema_bytes}",
                              param=where, code="schema_too_large")
    outside = outside_references(schema)
    if outside:
        path, ref = outside[0]
        raise BadRequestError(f"{where}.{path} = {ref[:200]!r} refers outside the schema; only local "
                              "references ('#/...') are allowed", param=where, code="schema_reference_not_allowed")
    if grammar:
        bad = unsupported_keywords(schema)
        if bad:
            raise BadRequestError(f"{where} uses JSON Schema features constrained decoding does not support: "
                                  f"{', '.join(bad[:10])}", param=where, code="unsupported_schema_feature")


def schema_depth(value: Any, limit: int) -> int:
    """Nesting depth of objects/arrays in `value`, counting stops once it passes `limit`."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_tool_schemas(tools: Sequence[ToolDefinition] | None, limits: RequestLimits) -> None:
    """Raise BadRequestError for the first tool whose schema breaks a limit."""
    if not tools:
        return
    if len(tools) > limits.max_tools:
        raise BadRequestError(f"{len(tools)} tools; at most {limits.max_tools} are allowed", param="tools",
                              code="too_many_tools")
    for i, tool in enumerate(tools):
        params = tool.function.parameters
        if params is not None:  # a strict function's schema must be one the grammar enforces whole
            check_schema(params, f"tools[{i}].function.parameters", limits, grammar=bool(tool.function.strict))
