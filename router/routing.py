"""Choosing a specialist for a chat request: a pinned model, the content classifier, or the default.

`model` naming a served specialist pins it. `model: "auto"` asks the content classifier, whose
probabilities are renormalized over the specialists this router serves; when the best of them is
below `threshold` (or there is no text, or no classifier) the request goes to `default` with reason
"fallback". Any other model name raises UnknownModelError (the HTTP layer answers 404).

What the classifier reads (`request_parts`): the last user message (weight 1.0), earlier user
messages (0.5), system/developer prompts (0.3) and the names of the offered and called tools (0.3).
Assistant text and tool results are not read. Content may be a string, None, or a list of parts
(only `text` parts count); malformed messages are skipped, never fatal.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from router.classifier import ContentClassifier

log = logging.getLogger(__name__)

AUTO = "auto"
LAST_USER_WEIGHT = 1.0
EARLIER_USER_WEIGHT = 0.5
SYSTEM_WEIGHT = 0.3
TOOLS_WEIGHT = 0.3


class RoutingError(ValueError):
    """Base of the router's errors."""


class UnknownModelError(RoutingError):
    """The requested model is neither "auto" nor a specialist this router serves."""

    def __init__(self, model: str, served: Sequence[str]) -> None:
        shown = repr(model) if len(model) <= 200 else f"{model[:200]!r}... ({len(model)} characters)"
        super().__init__(f"unknown model {shown}: use {AUTO!r} or one of {sorted(served)}")
        self.model = model
        self.served = list(served)


class RouterConfigError(RoutingError):
    """The router was built with specialists, a default or a threshold that cannot work."""


@dataclass
class RouteDecision:
    specialist: str  # chosen specialist name
    confidence: float  # classifier probability of the chosen class (1.0 when pinned)
    reason: Literal["pinned", "classifier", "fallback"]  # fallback: below threshold -> default
    scores: dict[str, float] = field(default_factory=dict)
    elapsed_ms: float = 0.0


def message_text(content: Any) -> str:
    """The text of a message's content: a string, None, or a list of OpenAI content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
        return "\n".join(texts)
    return ""


def _tool_name(tool: Any) -> str:
    """A tool's name from OpenAI's {"type": "function", "function": {...}} or a bare function dict."""
    if not isinstance(tool, dict):
        return ""
    fn = tool.get("function")
    name = fn.get("name") if isinstance(fn, dict) else tool.get("name")
    return name if isinstance(name, str) else ""


def request_parts(messages: Sequence[Any], tools: Sequence[Any] | None = None) -> list[tuple[str, float]]:
    """The weighted texts the classifier reads from one request (see the module docstring)."""
    users: list[str] = []
    parts: list[tuple[str, float]] = []
    names: list[str] = [_tool_name(t) for t in tools] if isinstance(tools, (list, tuple)) else []
    for m in messages if isinstance(messages, (list, tuple)) else ():
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        text = message_text(m.get("content"))
        if role == "user" and text.strip():
            users.append(text)
        elif role in ("system", "developer") and text.strip():
            parts.append((text, SYSTEM_WEIGHT))
        elif role == "assistant" and isinstance(m.get("tool_calls"), list):
            names += [_tool_name(c) for c in m["tool_calls"]]
    if users:
        parts += [(u, EARLIER_USER_WEIGHT) for u in users[:-1]] + [(users[-1], LAST_USER_WEIGHT)]
    names = [n for n in dict.fromkeys(names) if n]
    if names:
        parts.append((" ".join(names), TOOLS_WEIGHT))
    return parts


class Router:
    """Pinned model > content classifier > default."""

    def __init__(self, specialists: list[str], classifier: ContentClassifier | None, default: str,
                 threshold: float = 0.5) -> None:
        if not specialists or len(set(specialists)) != len(specialists):
            raise RouterConfigError(f"specialists must be non-empty and unique: {specialists}")
        if AUTO in specialists:
            raise RouterConfigError(f"{AUTO!r} is reserved and cannot name a specialist")
        if default not in specialists:
            raise RouterConfigError(f"default {default!r} is not among the specialists {specialists}")
        if not 0.0 <= threshold <= 1.0:
            raise RouterConfigError(f"threshold {threshold} is not in [0, 1]")
        self.specialists = list(specialists)
        self.classifier = classifier
        self.default = default
        self.threshold = threshold
        self._classified = [s for s in specialists if classifier is not None and s in classifier.labels]
        if classifier is not None and not self._classified:
            raise RouterConfigError(f"the classifier knows {classifier.labels}, none of {specialists}")

    def route(self, model: str, messages: list[dict], tools: list[dict] | None = None) -> RouteDecision:
        """Pick the specialist for `model` and the request's messages (and offered tools)."""
        start = time.perf_counter()
        if model in self.specialists:
            decision = RouteDecision(model, 1.0, "pinned", {model: 1.0})
        elif model != AUTO:
            raise UnknownModelError(model, self.specialists)
        else:
            decision = self._classify(messages, tools)
        decision.elapsed_ms = (time.perf_counter() - start) * 1e3
        return decision

    def _classify(self, messages: list[dict], tools: list[dict] | None) -> RouteDecision:
        parts = request_parts(messages, tools)
        if self.classifier is None or not parts:
            return RouteDecision(self.default, 0.0, "fallback", {})
        probs = self.classifier.predict_parts(parts)
        total = sum(probs[s] for s in self._classified)
        scores = {s: probs[s] / total for s in self._classified} if total > 0 else {}
        best = max(scores, key=scores.__getitem__, default=self.default)
        confidence = scores.get(best, 0.0)
        if confidence < self.threshold:
            return RouteDecision(self.default, scores.get(self.default, 0.0), "fallback", scores)
        return RouteDecision(best, confidence, "classifier", scores)
