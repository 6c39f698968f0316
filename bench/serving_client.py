"""One chat request over HTTP (aiohttp), streamed or not, measured: status, TTFT, latency, usage,
headers, text; the SSE stream parsed event by event ("data:" lines, a blank line ends an event)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.serving_mix import RequestSpec

CHAT_PATH = "/v1/chat/completions"


@dataclass
class Outcome:
    """What one request gave. `failure` is None for a success, else a short kind:
    "http_<status>", "sse_error:<type>", "cut_stream", "timeout", or a client exception's name."""

    index: int
    stream: bool
    failure: str | None = None
    status: int | None = None
    latency_s: float | None = None
    ttft_s: float | None = None  # streams: time to the first content or tool-call delta
    completion_tokens: int | None = None
    specialist: str | None = None  # x-cantata-specialist
    speculation_header: str | None = None  # x-speculation
    speculation_used: str | None = None  # a stream's final chunk `speculation`, else the header
    finish_reason: str | None = None
    text: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    error_message: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


@dataclass
class _StreamState:
    start: float
    ttft_s: float | None = None
    text: str = ""
    calls: dict[int, dict] = field(default_factory=dict)
    finish: str | None = None
    speculation: str | None = None
    usage: dict | None = None
    error: dict | None = None
    done: bool = False

    def feed(self, data: str) -> None:
        """One SSE event's data."""
        if data == "[DONE]":
            self.done = True
            return
        payload = json.loads(data)
        if "error" in payload:
            self.error = payload["error"]
            return
        if payload.get("usage"):
            self.usage = payload["usage"]
        if payload.get("speculation"):
            self.speculation = payload["speculation"]
        for choice in payload.get("choices") or []:
            delta = choice.get("delta") or {}
            if (delta.get("content") or delta.get("tool_calls")) and self.ttft_s is None:
                self.ttft_s = time.perf_counter() - self.start
            self.text += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                entry = self.calls.setdefault(tc.get("index", 0), {"name": "", "arguments": ""})
                fn = tc.get("function") or {}
                entry["name"] += fn.get("name") or ""
                entry["arguments"] += fn.get("arguments") or ""
            self.finish = choice.get("finish_reason") or self.finish


async def _read_events(resp: aiohttp.ClientResponse, state: _StreamState) -> None:
    lines: list[str] = []
    async for raw in resp.content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line:
            if line.startswith("data:"):
                lines.append(line[5:].lstrip(" "))
            continue
        if lines:
            state.feed("\n".join(lines))
            lines = []
    if lines:
        state.feed("\n".join(lines))


def _fill_headers(out: Outcome, resp: aiohttp.ClientResponse) -> None:
    out.status = resp.status
    out.specialist = resp.headers.get("x-cantata-specialist")
    out.speculation_header = resp.headers.get("x-speculation")


async def _error_body(out: Outcome, resp: aiohttp.ClientResponse) -> None:
    out.failure = f"http_{resp.status}"
    try:
        out.error_message = (await resp.json(content_type=None))["error"]["message"]
    except (ValueError, KeyError, TypeError, aiohttp.ClientError):
        out.error_message = (await resp.text())[:200]


async def _stream(session: aiohttp.ClientSession, url: str, spec: RequestSpec, out: Outcome, start: float) -> None:
    async with session.post(url, json=spec.body) as resp:
        _fill_headers(out, resp)
        if resp.status != 200:
            await _error_body(out, resp)
            return
        state = _StreamState(start)
        await _read_events(resp, state)
    out.ttft_s, out.text, out.finish_reason = state.ttft_s, state.text, state.finish
    out.tool_calls = [state.calls[k] for k in sorted(state.calls)]
    out.speculation_used = state.speculation or out.speculation_header
    out.completion_tokens = (state.usage or {}).get("completion_tokens")
    if state.error is not None:
        out.failure = f"sse_error:{state.error.get('type') or 'unknown'}"
        out.error_message = state.error.get("message")
    elif not state.done:
        out.failure = "cut_stream"


async def _complete(session: aiohttp.ClientSession, url: str, spec: RequestSpec, out: Outcome) -> None:
    async with session.post(url, json=spec.body) as resp:
        _fill_headers(out, resp)
        if resp.status != 200:
            await _error_body(out, resp)
            return
        body: dict[str, Any] = await resp.json(content_type=None)
    choice = body["choices"][0]
    message = choice.get("message") or {}
    out.text = message.get("content") or ""
    out.tool_calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                      for c in message.get("tool_calls") or []]
    out.finish_reason = choice.get("finish_reason")
    out.completion_tokens = (body.get("usage") or {}).get("completion_tokens")
    out.speculation_used = out.speculation_header


async def send(session: aiohttp.ClientSession, base_url: str, spec: RequestSpec) -> Outcome:
    """Send one request; never raises for the server's or the network's faults (they are the outcome).
    The session's timeout bounds the whole request."""
    out = Outcome(index=spec.index, stream=spec.stream)
    url = base_url.rstrip("/") + CHAT_PATH
    start = time.perf_counter()
    try:
        if spec.stream:
            await _stream(session, url, spec, out, start)
        else:
            await _complete(session, url, spec, out)
    except asyncio.TimeoutError:
        out.failure = "timeout"
    except aiohttp.ClientPayloadError as exc:  # the body ended early: for a stream, a cut stream
        out.failure = "cut_stream" if spec.stream else type(exc).__name__
        out.error_message = str(exc)[:200]
    except (aiohttp.ClientError, ValueError, KeyError, UnicodeDecodeError) as exc:
        out.failure = type(exc).__name__
        out.error_message = str(exc)[:200]
    out.latency_s = time.perf_counter() - start
    return out
