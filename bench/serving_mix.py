"""The request mix of `python -m bench.serving`: chat requests built from the held-out sets in
bench/data/<domain>/ (the test split exported by `specialists.train evalsets`; never training data).

Plain requests come from chat_prompts.jsonl rows that offer no tools; tool requests from
tool_convs.jsonl (the specialists' own tool schemas, tool_choice auto / required / named) and from
chat_prompts.jsonl rows that offer tools (tool_choice auto). The draw is reproducible from one seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import read_jsonl

DOMAINS = ("cpp", "python", "build", "shell")
SAMPLING = {"temperature": 0.8, "top_p": 0.95}


@dataclass(frozen=True)
class MixOptions:
    num_requests: int
    stream_fraction: float = 0.5
    tool_fraction: float = 0.2
    sampling_fraction: float = 0.2
    auto_fraction: float = 0.25
    max_tokens: int = 64
    seed: int = 0


@dataclass
class RequestSpec:
    """One request of the run: its JSON body and what it was drawn as."""

    index: int
    domain: str  # the domain its prompt came from
    model: str  # a specialist's name or "auto"
    stream: bool
    tool: bool
    sampled: bool
    body: dict[str, Any] = field(repr=False)

    @property
    def greedy_plain(self) -> bool:
        """Greedy and without tools: the requests whose output must not depend on the load."""
        return not self.sampled and not self.tool


@dataclass
class Pools:
    plain: dict[str, list[dict]]
    tools: dict[str, list[dict]]


def load_pools(data_dir: Path) -> Pools:
    plain: dict[str, list[dict]] = {}
    tools: dict[str, list[dict]] = {}
    for domain in DOMAINS:
        chat = read_jsonl(data_dir / domain / "chat_prompts.jsonl")
        convs = read_jsonl(data_dir / domain / "tool_convs.jsonl")
        plain[domain] = [{"messages": r["messages"]} for r in chat if not r.get("tools")]
        tools[domain] = ([{"messages": r["messages"], "tools": r["tools"], "expected": r["expected"]["name"]} for r in convs]
                         + [{"messages": r["messages"], "tools": r["tools"]} for r in chat if r.get("tools")])
        if not plain[domain] or not tools[domain]:
            raise ValueError(f"no held-out prompts for {domain} under {data_dir / domain}")
    return Pools(plain, tools)


def _tool_choice(row: dict, rng: random.Random) -> Any:
    if "expected" not in row:
        return "auto"
    pick = rng.choice(("auto", "required", "named"))
    return {"type": "function", "function": {"name": row["expected"]}} if pick == "named" else pick


def build_mix(pools: Pools, opts: MixOptions) -> list[RequestSpec]:
    """`opts.num_requests` requests: domain uniform, then auto / stream / tool / sampled drawn
    independently with their fractions, then a prompt of that kind from the domain's pool."""
    rng = random.Random(opts.seed)
    specs = []
    for i in range(opts.num_requests):
        domain = rng.choice(DOMAINS)
        model = "auto" if rng.random() < opts.auto_fraction else domain
        stream = rng.random() < opts.stream_fraction
        tool = rng.random() < opts.tool_fraction
        sampled = rng.random() < opts.sampling_fraction
        row = rng.choice(pools.tools[domain] if tool else pools.plain[domain])
        body: dict[str, Any] = {"model": model, "messages": row["messages"], "max_tokens": opts.max_tokens}
        if tool:
            body["tools"] = row["tools"]
            body["tool_choice"] = _tool_choice(row, rng)
        if sampled:
            body.update(SAMPLING, seed=rng.randrange(2**31))
        else:
            body["temperature"] = 0.0
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        specs.append(RequestSpec(i, domain, model, stream, tool, sampled, body))
    return specs


def determinism_sample(specs: list[RequestSpec], limit: int) -> list[RequestSpec]:
    """The first `limit` greedy requests without tools (in mix order)."""
    return [s for s in specs if s.greedy_plain][:limit]
