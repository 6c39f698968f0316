"""Triggers: where an accepted run of tokens must end (lesson 9: truncate first, then count).

A run is the tokens one engine step produced for a sequence (kept drafts plus the target's extra
token). It is cut right after its first trigger token, and nothing past the cut is committed or
emitted:
  - end of turn / EOS and the request's stop token ids: the request finishes ("stop");
  - the tool-call open tag: the sequence enters a tool-call segment, decoded without speculation;
  - the tool-call close tag: the turn ends with finish reason "tool_calls".
Stop strings are matched on the detokenized text by the engine, which cuts the run at the token that
completes the match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Event = Literal["eos", "stop_token", "tool_open", "tool_close"]


@dataclass(frozen=True)
class TriggerSet:
    eos_ids: frozenset[int]  # end of turn and end of text
    tool_open_id: int | None = None  # <tool_call>
    tool_close_id: int | None = None  # </tool_call>

    def event(self, token: int, stop_token_ids: list[int] | tuple[int, ...] = (), ignore_eos: bool = False) -> Event | None:
        if token in self.eos_ids and not ignore_eos:
            return "eos"
        if token in stop_token_ids:
            return "stop_token"
        if token == self.tool_open_id:
            return "tool_open"
        if token == self.tool_close_id:
            return "tool_close"
        return None

    def cut(self, run: list[int], stop_token_ids: list[int] | tuple[int, ...] = (), ignore_eos: bool = False) -> tuple[int, Event | None]:
        """Length of the run to keep (through the first trigger, inclusive) and that trigger."""
        for i, token in enumerate(run):
            ev = self.event(token, stop_token_ids, ignore_eos)
            if ev is not None:
                return i + 1, ev
        return len(run), None

    def open_segment(self, token_ids: list[int]) -> bool:
        """Whether token_ids end inside an unclosed tool call (a prompt with a forced call prefix)."""
        if self.tool_open_id is None:
            return False
        for token in reversed(token_ids):
            if token == self.tool_close_id or token in self.eos_ids:
                return False
            if token == self.tool_open_id:
                return True
        return False
