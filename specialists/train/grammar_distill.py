"""Self-distillation data for a drafter under a grammar: the checkpoint's own constrained replies.

Under `response_format` or a required tool call, the target writes JSON through the grammar's mask,
where a drafter trained only on free replies drafts what the unmasked model would write (on cpp, the
mask changed 82% of its drafts). This writes what the drafter should learn there: the checkpoint's
greedy replies under the grammar, as the server produces them (the chat template, the tools in the
system turn for a tool call and the reply after `<tool_call>`), beside its free greedy replies to the
same domain's chat prompts, packed for `python -m specialists.train mtp` (distill.py's streams).

Function schemas are made here from the Python standard library's own signatures (a parameter's type
from its default, its name and its docstring's first line), never from an evaluation set. User turns
are the domain's synthetic chat prompts (`python -m specialists.train chat`, a fresh seed) and requests
made from those docstrings.

  python -m specialists.train grammar-distill --model deploy/models/cpp --chat data/chat_s5/cpp/train.jsonl \\
      --corpus data/corpora/cpp/train.jsonl --out data/packed_grammar --domain cpp \\
      [--constrained 3000] [--free 2000] [--seed 5]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from specialists.chat import TOOL_CALL_OPEN, render
from specialists.wire import GrammarSpec, ToolGrammar

log = logging.getLogger(__name__)

MODULES = ("math", "statistics", "string", "textwrap", "os.path", "shutil", "random", "calendar", "datetime",
           "json", "re", "fnmatch", "glob", "zlib", "base64", "binascii", "hashlib", "ipaddress", "urllib.parse",
           "html", "difflib", "heapq", "bisect", "fractions", "colorsys", "locale", "time", "uuid", "secrets",
           "unicodedata", "keyword", "operator", "itertools", "functools", "shlex", "platform", "gzip", "tarfile")
NUMBER_NAMES = {"n", "k", "x", "y", "a", "b", "i", "j", "start", "stop", "step", "width", "size", "count", "level",
                "year", "month", "day", "hour", "minute", "second", "base", "ndigits", "number", "value", "indent"}


def function_schemas() -> list[dict[str, Any]]:
    """{name, description, parameters} of the listed modules' public functions with plain parameters."""
    out = []
    for mod_name in MODULES:
        mod = importlib.import_module(mod_name)
        for name, fn in sorted(vars(mod).items()):
            if name.startswith("_") or not callable(fn) or inspect.isclass(fn):
                continue
            try:
                sig = inspect.signature(fn)
            except (TypeError, ValueError):
                continue
            props, required = {}, []
            for p in sig.parameters.values():
                if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name == "self":
                    continue
                props[p.name] = _property(p, len(out))
                if p.default is p.empty:
                    required.append(p.name)
            doc = (inspect.getdoc(fn) or "").strip().split("\n")[0][:160]
            if not props or not doc:
                continue
            params = {"type": "object", "properties": props, "required": required}
            out.append({"name": f"{mod_name.replace('.', '_')}_{name}", "description": doc, "parameters": params})
    return out


def _property(p: inspect.Parameter, salt: int) -> dict[str, Any]:
    """A parameter's schema: its type, and for some string parameters (by a hash of the name and the
    function's index: the same every run) a list of strings or a described string instead."""
    kind = _type_of(p)
    pick = (sum(map(ord, p.name)) + salt) % 10
    if kind == "string" and pick == 0:
        return {"type": "array", "items": {"type": "string"}}
    if kind == "string" and pick in (1, 2):
        return {"type": "string", "description": f"the {p.name.replace('_', ' ')}"}
    return {"type": kind}


def _type_of(p: inspect.Parameter) -> str:
    d = p.default
    if isinstance(d, bool):
        return "boolean"
    if isinstance(d, int):
        return "integer"
    if isinstance(d, float):
        return "number"
    return "integer" if p.name in NUMBER_NAMES else "string"


def requests(chat: list[dict], functions: list[dict], n: int, seed: int) -> list[tuple[str, GrammarSpec]]:
    """n (rendered prompt, grammar) pairs, half response_format and half a required tool call; the
    user turn is a chat prompt or a request made from one offered function's docstring."""
    rng = random.Random(seed)
    questions = [m["content"] for row in chat for m in row["messages"][:2]
                 if m["role"] == "user" and isinstance(m.get("content"), str)]
    out = []
    for i in range(n):
        offered = rng.sample(functions, rng.randint(1, 3))
        if rng.random() < 0.5:
            d = offered[0]["description"].rstrip(".")
            user = f"{d[0].lower()}{d[1:]}, please." if rng.random() < 0.5 else f"Use {offered[0]['name']}: {d}."
        else:
            user = rng.choice(questions)
        messages = [{"role": "user", "content": user}]
        if i % 2 == 0:
            prompt = render(messages, None, True)
            spec = GrammarSpec(kind="json_schema", schema=offered[0]["parameters"])
        else:
            tools = [{"type": "function", "function": f} for f in offered]
            prompt = render(messages, tools, True) + TOOL_CALL_OPEN
            spec = GrammarSpec(kind="tool_call", tools=[ToolGrammar(name=f["name"], parameters=f["parameters"])
                                                        for f in offered])
        out.append((prompt, spec))
    return out


def replies(engine, items: list[tuple[str, GrammarSpec | None]], max_tokens: int, chunk: int, desc: str) -> list[tuple[list[int], list[int]]]:
    """Greedy replies (prompt ids, reply ids), `chunk` requests per engine.generate call."""
    from specialists.sampling import SamplingParams

    tok = engine.tokenizer
    out = []
    for start in tqdm(range(0, len(items), chunk), desc=desc, unit="chunk"):
        part = items[start:start + chunk]
        params = [SamplingParams(max_tokens=max_tokens, grammar=engine.grammar(s) if s is not None else None)
                  for _, s in part]
        for (prompt, _), res in zip(part, engine.generate([p for p, _ in part], params)):
            out.append((tok.encode(prompt, add_special_tokens=False), list(res.token_ids)))
    return out


def run(args: argparse.Namespace) -> dict:
    from policies.policy import SpeculationPolicy
    from specialists.engine import Engine
    from specialists.train.distill import pack_examples, write_split
    from specialists.train.pack import read_jsonl

    started = time.monotonic()
    engine = Engine.from_pretrained(args.model, policy=SpeculationPolicy(mode="off"), max_num_seqs=args.batch)
    eot = engine.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    chat = read_jsonl(args.chat)
    functions = function_schemas()
    rng = random.Random(args.seed)
    rng.shuffle(functions)
    cut = max(1, len(functions) // 10)  # held-out functions: the validation split's schemas
    constrained = requests(chat, functions[cut:], args.constrained, args.seed)
    constrained_val = requests(chat, functions[:cut], max(1, args.constrained // 20), args.seed + 1)
    free_rows = [r for r in chat if r["messages"][0]["role"] in ("system", "user")]
    rng.shuffle(free_rows)
    free = [(render([m for m in r["messages"] if m["role"] in ("system", "user")][:2], None, True), None)
            for r in free_rows[:args.free]]
    got = {name: replies(engine, items, args.max_tokens, args.batch * 4, name)
           for name, items in (("constrained", constrained), ("constrained_val", constrained_val), ("free", free))}
    gen_s = time.monotonic() - started
    train = [(p, r, True) for p, r in got["constrained"] + got["free"]]
    val = [(p, r, True) for p, r in got["constrained_val"]]
    text = np.zeros(0, dtype=np.uint16)
    if args.corpus is not None:  # the domain's raw text, as the drafter first trained on it
        from specialists.train.pack import pack_text
        text = pack_text(engine.tokenizer, [r["text"] for r in read_jsonl(args.corpus)], args.text_tokens, eot)
    base = args.out / args.domain
    summary = {"train": write_split(base / "train", text, pack_examples(train, eot)),
               "validation": write_split(base / "validation", text[:4096], pack_examples(val, eot))}
    summary.update(model=str(args.model), functions=len(functions), constrained=len(constrained), free=len(free),
                   reply_tokens={k: sum(len(r) for _, r in v) for k, v in got.items()}, seed=args.seed,
                   generate_s=round(gen_s, 1))
    (args.out / "grammar_distill.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(args.out / "replies.jsonl", "w", encoding="utf-8") as f:
        for name, items in (("constrained", constrained), ("free", free)):
            for (prompt, spec), (_, reply) in zip(items, got[name]):
                row = {"kind": name, "prompt": prompt[-300:], "grammar": spec.kind if spec else None,
                       "reply": engine.tokenizer.decode(reply)}
                if spec is not None:  # what the reply had to follow
                    row.update(schema=spec.schema_) if spec.kind == "json_schema" else row.update(offered=[t.name for t in spec.tools])
                f.write(json.dumps(row) + "\n")
    return summary


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m specialists.train grammar-distill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--chat", type=Path, required=True, help="the domain's synthetic chat conversations (JSONL)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--domain", default="cpp")
    p.add_argument("--corpus", type=Path, help="the domain's raw text (corpus JSONL with a text field)")
    p.add_argument("--text-tokens", type=int, default=2_000_000)
    p.add_argument("--constrained", type=int, default=3000)
    p.add_argument("--free", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=5)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    print(json.dumps(run(args), indent=2))
    return 0
