"""Streaming tool-call deltas: `ToolCallStreamer` turns a reply's text, as it arrives, into OpenAI
content and tool-call deltas. Calls go through `router.tools.convert_call`, as a whole reply's do
(`extract_tool_calls`), so both report the same calls and the same argument errors."""

from __future__ import annotations

import asyncio

from router.api import Delta, DeltaFunctionCall, DeltaToolCall, ResponseToolCall, ToolCallError
from router.tools import ToolPlan, convert_call
from specialists.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ParsedToolCall, call_end, parse_tool_calls


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallStreamer:
    """Turns streamed text into OpenAI deltas: content deltas, and for each completed
    `<tool_call>...</tool_call>` block two tool-call deltas (id, type and name first, then the
    arguments), as OpenAI streams them. Text that might start a `<tool_call>` tag is held back
    until it is known not to."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._buf = ""
        self._in_call = False
        self.calls: list[ResponseToolCall] = []
        self.errors: list[ToolCallError] = []
        self._stopped = False  # parallel=False and a call was emitted

    def feed(self, text: str) -> list[Delta]:
        if not text:
            return []
        if not self.plan.parse_calls:
            return [Delta(content=text)]
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Delta]:
        """Flush at the end of the reply: held-back text, and an unterminated call as an error."""
        if not self.plan.parse_calls:
            return []
        out = self._drain(final=True)
        if self._in_call and not self._stopped:
            deltas = self._emit_call(ParsedToolCall(None, None, self._buf, "unterminated tool call"))
            out += deltas
        self._buf, self._in_call = "", False
        return out

    async def afeed(self, text: str) -> list[Delta]:
        """`feed`, run in a worker thread when it may complete a call (whose arguments are then
        validated against a client's schema), so the event loop never waits on a validation."""
        if self.plan.parse_calls and self.plan.schemas and TOOL_CALL_CLOSE in self._buf[-len(TOOL_CALL_CLOSE):] + text:
            return await asyncio.to_thread(self.feed, text)
        return self.feed(text)

    async def afinish(self) -> list[Delta]:
        """`finish`, in a worker thread when tools are parsed (see `afeed`)."""
        if self.plan.parse_calls and self.plan.schemas:
            return await asyncio.to_thread(self.finish)
        return self.finish()

    @property
    def finish_reason_override(self) -> str | None:
        return "tool_calls" if self.calls else None

    def _drain(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            if self._in_call:
                end = call_end(self._buf, 0, final)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(TOOL_CALL_CLOSE):]
                self._in_call = False
                if not self._stopped:
                    out += self._emit_call(_parse_block(body))
                continue
            start = self._buf.find(TOOL_CALL_OPEN)
            if start >= 0:
                before = self._buf[:start]
                self._buf = self._buf[start + len(TOOL_CALL_OPEN):]
                self._in_call = True
                if before and not self._stopped:
                    out.append(Delta(content=before))
                continue
            keep = 0 if final else _held_back(self._buf, TOOL_CALL_OPEN)
            text, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            text = text.replace(TOOL_CALL_CLOSE, "")
            if text and not self._stopped:
                out.append(Delta(content=text))
            return out

    def _emit_call(self, parsed: ParsedToolCall) -> list[Delta]:
        call, err = convert_call(parsed, self.plan, len(self.calls))
        if err is not None:
            self.errors.append(err)
        if call is None:
            return []
        index = len(self.calls)
        self.calls.append(call)
        if not self.plan.parallel:
            self._stopped = True
        return [
            Delta(tool_calls=[DeltaToolCall(index=index, id=call.id, type="function",
                                            function=DeltaFunctionCall(name=call.function.name, arguments=""))]),
            Delta(tool_calls=[DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.function.arguments))]),
        ]


def _parse_block(body: str) -> ParsedToolCall:
    """One `<tool_call>` body, parsed exactly as `parse_tool_calls` parses it."""
    _, calls = parse_tool_calls(f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}")
    return calls[0] if calls else ParsedToolCall(None, None, body, "empty tool call")
