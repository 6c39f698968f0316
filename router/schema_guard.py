"""Tool schemas are data: limits checked when a request arrives, before anything renders or
validates against them.

* at most `max_tools` tools;
* one tool's `parameters`, as compact JSON, at most `max_schema_bytes`, nested at most
  `max_schema_depth` objects/arrays deep;
* every `$ref` / `$dynamicRef` / `$recursiveRef` points inside the schema (`#/...`): a reference
  to a file or a URL is refused by name (validation would refuse to follow it anyway, see
  specialists/json_schema.py; refusing here tells the client at once).

Each breach is a 400 in OpenAI's shape naming the tool (`param: tools[i].function.parameters`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from router.api import BadRequestError, ToolDefinition
from router.limits import RequestLimits
from specialists.json_schema import outside_references


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
        if params is None:
            continue
        where = f"tools[{i}].function.parameters"
        depth = schema_depth(params, limits.max_schema_depth)
        if depth > limits.max_schema_depth:
            raise BadRequestError(f"{where} is nested deeper than {limits.max_schema_depth} levels", param=where,
                                  code="schema_too_deep")
        size = len(json.dumps(params, separators=(",", ":"), ensure_ascii=False, default=str))
        if size > limits.max_schema_bytes:
            raise BadRequestError(f"{where} is {size} characters as JSON; the limit is {limits.max_schema_bytes}",
                                  param=where, code="schema_too_large")
        outside = outside_references(params)
        if outside:
            path, ref = outside[0]
            raise BadRequestError(f"{where}.{path} = {ref[:200]!r} refers outside the schema; only local "
                                  "references ('#/...') are allowed", param=where, code="schema_reference_not_allowed")
