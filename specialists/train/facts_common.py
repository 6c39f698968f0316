"""What the conversation synthesizer extracts from one corpus document, and helpers the
per-domain extractors (facts_cpp, facts_python, facts_build, facts_shell) share."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

LICENSE_MARKERS = ("Copyright", "copyright", "License", "LICENSE", "WITHOUT ANY WARRANTY", "SPDX", "license")



@dataclass
class Explain:
    """A question answerable from the document: `style` picks the question templates."""

    style: str
    vars: dict[str, str]
    answer: str


@dataclass
class CallSpec:
    """A request that needs `tool`, grounded in the document."""

    tool: str
    arguments: dict[str, Any]                      # required arguments
    optional: dict[str, Any]                       # included only when the request template mentions them
    vars: dict[str, str]                           # request template variables
    result: str                                    # the tool message content
    answer: str                                    # final answer after the tool result ({result} free)
    direct: str                                    # answer when no tools are offered


@dataclass
class DocFacts:
    path: str
    text: str
    fence: str
    explains: list[Explain] = field(default_factory=list)
    calls: list[CallSpec] = field(default_factory=list)


def _clip(text: str, limit: int) -> str:
    text = text.strip()
    if len(text) <= limit:
        return text
    cut = text[:limit]
    for stop in (". ", "\n"):
        i = cut.rfind(stop)
        if i > limit // 2:
            return cut[: i + 1].strip()
    return cut.rsplit(" ", 1)[0].strip() + " ..."


def _sentences(text: str, n: int = 2, limit: int = 300) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z`(\"'])", text)
    out = " ".join(parts[:n]).strip()
    return _clip(out, limit)


def _is_license(text: str) -> bool:
    return any(m in text for m in LICENSE_MARKERS)


def _clip_lines(text: str, max_lines: int, max_chars: int) -> str:
    lines = text.splitlines()[:max_lines]
    out = "\n".join(line[:160] for line in lines)
    return out[:max_chars]

