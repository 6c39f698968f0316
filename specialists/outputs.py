"""What the engine hands back: a request's output so far (`RequestOutput`), the error of a request it
cannot serve (`RequestError`, `prompt_ids`), and how a request's speculation status merges step by step."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from spec.stats import RequestStats


class RequestError(ValueError):
    """A request the engine cannot serve (empty or over-long prompt, ids that are not the model's)."""


def prompt_ids(prompt: Any, vocab_size: int) -> list[int]:
    """A prompt given as token ids -> a list of ints in [0, vocab_size); RequestError for anything else
    (a mapping, strings, an id past the embedding: it would fail the whole batch's step, not this one)."""
    try:
        ids = [operator.index(t) for t in prompt]
    except TypeError:
        raise RequestError(f"a prompt is a string or a list of token ids, not {type(prompt).__name__}") from None
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside this model's vocabulary [0, {vocab_size})")
    return ids


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "tool_calls" | "grammar_error" | None while running
    finished: bool
    speculation: str = "off"  # on | off | fallback: what this request used so far
    stats: RequestStats | None = None  # shared, live: read it, do not keep it across steps


def merge_status(before: str, now: str) -> str:
    """A request that ever fell back says so; otherwise on if it ever speculated."""
    if "fallback" in (before, now):
        return "fallback"
    return "on" if "on" in (before, now) else "off"
