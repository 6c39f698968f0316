"""Checks on a parsed chat request that pydantic's field types do not express, run first in
`ChatService.prepare`, each a 400 in OpenAI's shape naming the parameter:

* parameters we do not implement are refused by name, never ignored: `n` > 1, `logprobs`,
  `top_logprobs`, `logit_bias`, non-zero `presence_penalty` / `frequency_penalty`, `repetition_penalty`
  other than 1, `min_p` other than 0 (`response_format` is checked in router/tools.py), the legacy
  `functions` / `function_call`, audio output, `prediction`, `web_search_options`, `best_of` > 1,
  `echo`, and vLLM's guided-decoding fields;
* `seed` within [0, 2**63 - 1] (what the engine's generators take);
* no string anywhere in the request holds a lone surrogate (JSON "\\ud800", or raw bytes that
  decode to one): such text cannot be encoded as UTF-8 and would fail deep inside the service;
* each stop sequence at most `max_stop_chars` long; tool schemas within their limits
  (router/schema_guard.py).
"""

from __future__ import annotations

from typing import Any

from router.api import BadRequestError, ChatCompletionRequest
from router.limits import RequestLimits
from router.schema_guard import check_tool_schemas

SEED_MAX = 2**63 - 1
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def _unsupported(req: ChatCompletionRequest) -> tuple[str, str] | None:
    """(param, why) of the first parameter that asks for something this server does not do."""
    checks: list[tuple[str, bool, str]] = [
        ("n", req.n not in (None, 1), "only n=1 is supported"),
        ("logprobs", bool(req.logprobs), "logprobs are not supported"),
        ("top_logprobs", req.top_logprobs not in (None, 0), "top_logprobs are not supported"),
        ("logit_bias", bool(req.logit_bias), "logit_bias is not supported"),
        ("presence_penalty", req.presence_penalty not in (None, 0), "presence_penalty is not supported (only 0)"),
        ("frequency_penalty", req.frequency_penalty not in (None, 0), "frequency_penalty is not supported (only 0)"),
        ("repetition_penalty", req.repetition_penalty not in (None, 1), "repetition_penalty is not supported (only 1)"),
        ("min_p", req.min_p not in (None, 0), "min_p is not supported (only 0)"),
        ("functions", req.functions is not None, "functions is not supported: use tools"),
        ("function_call", req.function_call is not None, "function_call is not supported: use tool_choice"),
        ("modalities", req.modalities not in (None, ["text"]), 'only modalities ["text"] is supported'),
        ("audio", req.audio is not None, "audio output is not supported"),
        ("prediction", req.prediction is not None, "predicted outputs are not supported"),
        ("web_search_options", req.web_search_options is not None, "web search is not supported"),
        ("best_of", req.best_of not in (None, 1), "best_of is not supported"),
        ("echo", bool(req.echo), "echo is not supported"),
    ]
    checks += [(name, getattr(req, name) is not None, f"{name} (guided decoding) is not supported")
               for name in GUIDED_FIELDS]
    for param, refused, why in checks:
        if refused:
            return param, why
    return None


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """Path of the first string (value or key) in `value` holding a lone surrogate, else None."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(node, dict):
            for key, child in node.items():
                here = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and lone_surrogate(key) is not None:
                    return here.encode("utf-8", "replace").decode()
                stack.append((child, here))
        elif isinstance(node, (list, tuple)):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(node))
    return None


def check_request(req: ChatCompletionRequest, limits: RequestLimits) -> None:
    """Raise BadRequestError for the first problem in `req` (see the module's docstring)."""
    refused = _unsupported(req)
    if refused is not None:
        param, why = refused
        raise BadRequestError(why, param=param, code="unsupported_parameter")
    if req.seed is not None and not 0 <= req.seed <= SEED_MAX:
        raise BadRequestError(f"seed must be an integer in [0, {SEED_MAX}]", param="seed", code="invalid_value")
    check_tool_schemas(req.tools, limits)  # before the walk below: a schema over its size limit stops here
    where = lone_surrogate(req.model_dump(exclude_none=True, mode="python"))
    if where is not None:
        raise BadRequestError(f"{where} holds a lone UTF-16 surrogate, which is not valid Unicode text", param=where,
                              code="invalid_unicode")
    for i, stop in enumerate(req.stop_list()):
        if len(stop) > limits.max_stop_chars:
            raise BadRequestError(f"stop[{i}] is {len(stop)} characters; the limit is {limits.max_stop_chars}",
                                  param="stop", code="invalid_value")
