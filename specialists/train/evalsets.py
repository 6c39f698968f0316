"""Export the held-out evaluation sets (test split only) into bench/data/<domain>/.

    python -m specialists.train evalsets --corpora data/corpora --chat data/chat --out bench/data [--n 200]

Per domain:
* prompts.jsonl       {"prompt": a cut of a test document ending at a line boundary (200-600 chars),
                       "reference": the next ~300 characters of that document, "path": ...}
* tool_convs.jsonl    {"messages": the conversation up to and including the user request, "tools": [...],
                       "expected": {"name": ..., "arguments": {...}}}   (from test "tool" conversations)
* chat_prompts.jsonl  {"messages": ..., "tools": [...] | null, "kind": ...}   (all kinds, incl. no-tool prompts)

Everything is deterministic; the folder stays small (it is committed).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path
from typing import Any, Iterator

from specialists.train.chatdata import iter_docs
from specialists.train.domains import DOMAINS

log = logging.getLogger(__name__)

PROMPT_MIN, PROMPT_MAX, REFERENCE_CHARS = 200, 600, 300
MAX_PROMPT_LINE = 200  # documents with very long lines (minified, tables) make poor prompts


def cut_prompt(text: str, rng: random.Random) -> tuple[str, str] | None:
    """A prompt of 200-600 chars ending at a line boundary and the next ~300 chars, or None."""
    if len(text) < PROMPT_MIN + 100:
        return None
    starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n" and i + 1 < len(text) - PROMPT_MIN - 100]
    for _ in range(10):
        start = rng.choice(starts)
        target = start + rng.randint(PROMPT_MIN, PROMPT_MAX)
        end = text.rfind("\n", start + PROMPT_MIN, min(target, start + PROMPT_MAX) + 1)
        if end < 0:
            continue
        prompt = text[start: end + 1]
        reference = text[end + 1: end + 1 + REFERENCE_CHARS]
        if len(reference.strip()) < 50 or not prompt.strip():
            continue
        if max(len(line) for line in prompt.splitlines()) > MAX_PROMPT_LINE:
            continue
        return prompt, reference
    return None


def completion_prompts(corpora: Path, domain: str, n: int, seed: int) -> list[dict[str, Any]]:
    docs = [d for d in iter_docs(corpora, domain, "test")]
    rng = random.Random(f"{seed}:prompts:{domain}")
    order = list(range(len(docs)))
    rng.shuffle(order)
    out: list[dict[str, Any]] = []
    # round-robin over documents so one big file does not dominate
    for _round in range(4):
        for i in order:
            if len(out) >= n:
                return out
            cut = cut_prompt(docs[i]["text"], rng)
            if cut is not None:
                out.append({"path": docs[i]["path"], "prompt": cut[0], "reference": cut[1]})
    return out


def _conversations(chat_dir: Path, domain: str) -> Iterator[dict[str, Any]]:
    path = chat_dir / domain / "test.jsonl"
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _until_first_request(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages up to and including the first user message."""
    out = []
    for m in messages:
        out.append(m)
        if m["role"] == "user":
            break
    return out


def tool_conversations(chat_dir: Path, domain: str, n: int) -> list[dict[str, Any]]:
    out = []
    seen: set[str] = set()
    for conv in _conversations(chat_dir, domain):
        if conv["kind"] != "tool":
            continue
        prefix = _until_first_request(conv["messages"])
        key = prefix[-1]["content"]
        if key in seen:
            continue
        seen.add(key)
        reply = conv["messages"][len(prefix)]
        call = reply["tool_calls"][0]["function"]
        out.append({"messages": prefix, "tools": conv["tools"],
                    "expected": {"name": call["name"], "arguments": call["arguments"]}})
        if len(out) >= n:
            break
    return out


def chat_prompts(chat_dir: Path, domain: str, n: int) -> list[dict[str, Any]]:
    """A mix of all kinds, no-tool prompts (tools null) making up at least a third."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    seen: set[str] = set()
    for conv in _conversations(chat_dir, domain):
        row = {"messages": _until_first_request(conv["messages"]), "tools": conv["tools"], "kind": conv["kind"]}
        key = json.dumps([row["messages"][-1]["content"], row["tools"] is None])
        if key in seen:
            continue
        seen.add(key)
        by_kind.setdefault(conv["kind"], []).append(row)
    out: list[dict[str, Any]] = []
    kinds = sorted(by_kind)
    i = 0
    while len(out) < n and any(i < len(v) for v in by_kind.values()):
        for kind in kinds:
            if i < len(by_kind[kind]) and len(out) < n:
                out.append(by_kind[kind][i])
        i += 1
    return out


def _write(path: Path, rows: list[dict[str, Any]]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
    return path.stat().st_size


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m specialists.train evalsets", description=__doc__.split("\n")[0])
    parser.add_argument("--corpora", type=Path, default=Path("data/corpora"))
    parser.add_argument("--chat", type=Path, default=Path("data/chat"))
    parser.add_argument("--out", type=Path, default=Path("bench/data"))
    parser.add_argument("--n", type=int, default=200, help="rows per file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    total = 0
    for domain in DOMAINS:
        sizes = {
            "prompts": _write(args.out / domain / "prompts.jsonl", completion_prompts(args.corpora, domain, args.n, args.seed)),
            "tool_convs": _write(args.out / domain / "tool_convs.jsonl", tool_conversations(args.chat, domain, args.n)),
            "chat_prompts": _write(args.out / domain / "chat_prompts.jsonl", chat_prompts(args.chat, domain, args.n)),
        }
        total += sum(sizes.values())
        log.info("%s: %s bytes", domain, sizes)
    log.info("wrote %s (%.2f MB)", args.out, total / 1e6)
    if total > 2_000_000:
        log.warning("%s is %.2f MB (> 2 MB); lower --n", args.out, total / 1e6)
    return 0
