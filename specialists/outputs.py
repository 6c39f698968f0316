"""What the engine hands back: a request's output so far (`RequestOutput`), the error of a request it
cannot serve (`RequestError`), and how a request's speculation status merges step by step."""

from __future__ import annotations

from dataclasses import dataclass

from spec.stats import RequestStats


class RequestError(ValueError):
    """A request the engine cannot serve (empty or over-long prompt)."""


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
