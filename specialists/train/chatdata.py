"""Synthesize chat and tool-call conversations from the domain corpora.

    python -m specialists.train chat --corpora data/corpora --out data/chat [--per-domain 20000] [--seed 0]

Every conversation is built from one real corpus document of the same split (train conversations from train
documents, test ones from test documents) and written to <out>/<domain>/<split>.jsonl as
{"messages": [...OpenAI-style...], "tools": [...] | null, "kind": str}. Kinds:

* continue  the user pastes a few lines of a document; the assistant gives the next lines.
* explain   a question answered from the document itself (docstrings, doc comments, CMake .rst blocks,
            man page NAME lines, script header comments).
* tool      the domain's tools are offered; the request needs one: one call with valid arguments, a tool
            message whose result is derived from the document, and a short final answer.
* notool    the same kind of request with no tools offered: the assistant answers directly.

continue/explain rows sometimes offer tools too (the answer then never calls one).
Validation and test get 5% of the train count each. Output is deterministic given --seed.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from specialists.chat import render
from specialists.train.corpus import iter_documents
from specialists.train.domains import DOMAINS, SPLITS
from specialists.train.facts_build import build_facts
from specialists.train.facts_common import CallSpec, DocFacts, _is_license
from specialists.train.facts_cpp import cpp_facts
from specialists.train.facts_python import _SAFE_BUILTINS, python_facts
from specialists.train.facts_shell import shell_facts
from specialists.train.tools import tools_for

__all__ = ["_SAFE_BUILTINS", "cli", "extract_facts", "iter_docs", "load_pool", "synthesize"]  # tests evaluate run_python calls with _SAFE_BUILTINS

log = logging.getLogger(__name__)

MAX_POOL_DOCS = 5000        # documents per domain/split considered (deterministic subsample)
MAX_DOC_CHARS = 120_000     # longer documents are truncated before extraction
MAX_RENDERED_CHARS = 3000   # ~1000 tokens: keeps every conversation inside the 1024-token context
ANSWER_CHARS = 420          # "continue" answers stay under ~150 tokens
KIND_WEIGHTS: dict[str, float] = {"continue": 0.25, "explain": 0.2, "tool": 0.35, "notool": 0.2}
TOOLS_ON_PLAIN_RATE = 0.3   # continue/explain rows that still offer tools


def iter_docs(corpora: Path, domain: str, split: str) -> Iterator[dict[str, Any]]:
    """Documents of one corpus split ({"path", "text", "source"} dicts)."""
    return iter_documents(Path(corpora), domain, split)


EXTRACTORS: dict[str, Callable[[str, str, random.Random], DocFacts]] = {
    "cpp": cpp_facts, "python": python_facts, "build": build_facts, "shell": shell_facts,
}


def extract_facts(domain: str, doc: dict[str, Any], seed: int) -> DocFacts:
    """Questions and tool requests grounded in one document (deterministic in seed and path)."""
    text = doc["text"][:MAX_DOC_CHARS]
    rng = random.Random(f"{seed}:{doc['path']}")
    try:
        return EXTRACTORS[domain](doc["path"], text, rng)
    except (RecursionError, ValueError, IndexError) as exc:
        log.debug("extraction failed for %s: %s", doc["path"], exc)
        fence = {"cpp": "cpp", "python": "python", "build": "", "shell": "sh"}[domain]
        return DocFacts(doc["path"], text, fence)


# ----------------------------------------------------------------------------------------------- templates

REQUESTS: dict[str, list[str]] = {
    "lookup_symbol": [
        "Where is `{symbol}` declared?", "Look up {symbol} for me.", "What's the declaration of `{symbol}`?",
        "Find `{symbol}` in the headers.", "Show me the signature of {symbol}.",
        "I need the declaration of `{symbol}` from <{header}>.", "Which header declares {symbol}?",
        "Can you look up `{symbol}`?", "How is `{symbol}` declared?", "Search <{header}> for {symbol}.",
        "lookup {symbol}", "What is the exact signature of {symbol}?", "Get me the prototype of `{symbol}` in {header}.",
    ],
    "compile_snippet": [
        "Does this compile with -std={std}?\n```cpp\n{code}```", "Compile this as {std}:\n```cpp\n{code}```",
        "Check this snippet with {std}, please.\n```cpp\n{code}```", "Can you syntax-check this ({std})?\n```cpp\n{code}```",
        "```cpp\n{code}```\nWill g++ accept that in {std} mode?", "Run g++ -std={std} -fsyntax-only on:\n```cpp\n{code}```",
        "Is this valid {std}?\n```cpp\n{code}```", "Quick compile check under {std}:\n```cpp\n{code}```",
        "Try compiling the following with {std}.\n```cpp\n{code}```", "Any errors in this when built as {std}?\n```cpp\n{code}```",
    ],
    "run_python": [
        "Run this Python:\n```python\n{code}\n```", "What does `{code}` evaluate to?", "Evaluate {code}",
        "Can you execute this for me?\n```python\n{code}\n```", "What's the output of:\n```python\n{code}\n```",
        "Compute `{code}` in Python.", "Please run `{code}` and tell me the result.", "python: {code}",
        "I need the value of this expression: {code}", "Execute the snippet below.\n```python\n{code}\n```",
        "Quick check, what is {code}?",
    ],
    "pydoc": [
        "Show me the docs for `{name}`.", "What does {name} do?", "pydoc {name}", "What's the signature of `{name}`?",
        "Look up the docstring of {name}.", "How do I use `{name}`?", "Can you get help on {name}?",
        "Explain `{name}` from its documentation.", "What arguments does {name} take?", "I need the help text for {name}.",
        "Describe {name} (module {module}).",
    ],
    "cmake_build": [
        "Build target `{target}`.", "Build {target} in {build_dir}/.", "Please compile the `{target}` target ({config}).",
        "cmake --build for target {target}, please.", "Can you build `{target}` in {config} mode?",
        "Run the {target} target in the {build_dir} build directory.", "Rebuild {target}.",
        "I need `{target}` built with the {config} configuration in {build_dir}.", "Kick off a build of {target}.",
        "Make sure `{target}` builds.", "Build the project's {target} target.",
    ],
    "make_target": [
        "Run `make {target}`.", "Run make {target} with {jobs} jobs.", "Please make the {target} target.",
        "Can you run the `{target}` target from {file}?", "make {target} -j{jobs}", "Build `{target}` with make.",
        "Execute the {target} rule.", "Invoke make for {target}, {jobs} parallel jobs.", "Try `make {target}` for me.",
        "I need the `{target}` target run.", "What happens when I run make {target}? Run it.",
    ],
    "cmake_help": [
        "What does the CMake module {module} do?", "Show the documentation of {module}.", "cmake --help-module {module}",
        "How do I use `{module}`?", "Tell me about the {module} module.", "Look up {module} in the CMake docs.",
        "What is {module} for?", "Can you get the help for CMake's `{module}`?", "Explain the {module} module.",
        "I want to include({module}). What does it provide?",
    ],
    "run_shell": [
        "Run `{command}`.", "Execute {command}", "Can you run `{command}` for me?", "What does `{command}` print?",
        "Please run this: {command}", "$ {command}", "Run `{command}` with a {timeout_s}s timeout.",
        "Show me the output of `{command}`.", "I need the result of {command}.", "Try `{command}`.",
        "Run {command} (timeout {timeout_s} seconds).",
    ],
    "man_page": [
        "Show the man page of `{name}`.", "What does {name} do?", "man {name}", "Open the manual for {name}.",
        "How do I use `{name}`?", "Look up {name} in section {section} of the manual.", "What's the synopsis of {name}?",
        "man {section} {name}", "Can you check the manual page for `{name}`?", "Get me the usage of {name}.",
        "Tell me what `{name}` is for.",
    ],
}

EXPLAIN_QUESTIONS: dict[str, list[str]] = {
    "cpp_function": ["What does `{symbol}` do?", "Explain {symbol}.", "What is {symbol} for?",
                     "Briefly, what does {symbol} (from <{header}>) do?", "What's the purpose of `{symbol}`?"],
    "cpp_class": ["What is `{symbol}`?", "Explain the class {symbol}.", "What is {symbol} used for?",
                  "Describe {symbol} from <{header}>.", "What does the type `{symbol}` represent?"],
    "py_function": ["What does `{name}` do?", "Explain {name}.", "What is the function {name} for?",
                    "In one or two sentences, what does {name} do?", "Describe `{name}`."],
    "py_method": ["What does the method `{name}` do?", "Explain {name}.", "What is {name} for?",
                  "Describe the method {name}."],
    "py_class": ["What is the class `{name}`?", "Explain {name}.", "What is {name} used for?", "Describe `{name}`."],
    "py_module": ["What is the module `{name}` for?", "Explain the {name} module.", "What does {name} provide?",
                  "Describe the Python module `{name}`."],
    "cmake_module": ["What does the CMake module {module} do?", "What is {module} for?", "Explain {module}.",
                     "Describe the `{module}` module in one or two sentences."],
    "make_target": ["What does the `{target}` target in {file} do?", "Explain the {target} rule.",
                    "What is `make {target}` for?"],
    "gnulib_module": ["What is the gnulib module `{module}`?", "What does gnulib's {module} module provide?",
                      "Explain the {module} gnulib module.", "What is {module} in gnulib for?"],
    "m4_macro": ["What does the m4 macro `{macro}` do?", "Explain {macro}.", "What is {macro} (from {file}) for?",
                 "Describe the autoconf macro {macro}."],
    "man": ["What does `{name}` do?", "What is {name}?", "Describe the command {name}.", "What is {name} for?",
            "In one line, what does `{name}` do?"],
    "script": ["What does the script `{script}` do?", "Explain {path}.", "What is {script} for?",
               "Describe what {path} does."],
}

# A continuation is always the next CONTINUE_LINES lines (fewer only at the end of a document or past
# ANSWER_CHARS): a fixed length that a tiny model learns to stop at, instead of looping.
CONTINUE_LINES = 4

CONTINUE_REQUESTS: list[str] = [
    "Continue this code:\n```{fence}\n{snippet}\n```", "What comes next?\n```{fence}\n{snippet}\n```",
    "Complete the following from `{path}`:\n```{fence}\n{snippet}\n```",
    "Here is part of {base}. Continue it.\n```{fence}\n{snippet}\n```",
    "```{fence}\n{snippet}\n```\nContinue.", "Write the next few lines:\n```{fence}\n{snippet}\n```",
    "Keep going from here:\n```{fence}\n{snippet}\n```", "Finish this snippet.\n```{fence}\n{snippet}\n```",
    "Continue the text of {path}:\n```{fence}\n{snippet}\n```", "What follows this?\n```{fence}\n{snippet}\n```",
]

SYSTEM_PROMPTS: dict[str, list[str]] = {
    "cpp": ["You are Cantata's C and C++ specialist. Answer briefly.", "You help with C++ code and the standard library."],
    "python": ["You are Cantata's Python specialist. Answer briefly.", "You help with Python code and its standard library."],
    "build": ["You are Cantata's build-system specialist (CMake, make, autoconf). Answer briefly.",
              "You help with CMake and Makefiles."],
    "shell": ["You are Cantata's shell specialist. Answer briefly.", "You help with Unix commands and shell scripts."],
}

PREFACES: list[str] = ["Let me check.", "I'll look that up.", "One moment.", "Running it now."]


class _Format(dict):
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def _fmt(template: str, values: dict[str, Any]) -> str:
    return template.format_map(_Format({k: str(v) for k, v in values.items()}))


# ------------------------------------------------------------------------------------------- conversations


@dataclass
class Synthesizer:
    """Builds conversations of one domain and split from a pool of documents."""

    domain: str
    docs: list[dict[str, Any]]
    seed: int = 0
    facts: list[DocFacts] = field(init=False)

    def __post_init__(self) -> None:
        from tqdm import tqdm

        self.facts = [extract_facts(self.domain, d, self.seed)
                      for d in tqdm(self.docs, desc=f"{self.domain} facts", leave=False, disable=len(self.docs) < 50)]
        self.with_explain = [f for f in self.facts if f.explains]
        self.with_call: dict[str, list[DocFacts]] = {}
        for f in self.facts:
            for c in f.calls:
                bucket = self.with_call.setdefault(c.tool, [])
                if not bucket or bucket[-1] is not f:
                    bucket.append(f)
        self.with_lines = [f for f in self.facts if f.text.count("\n") >= 6]
        self.tools = tools_for(self.domain)

    def counts(self) -> dict[str, int]:
        return {"docs": len(self.facts), "explain_docs": len(self.with_explain),
                **{f"{k}_docs": len(v) for k, v in self.with_call.items()}}

    # --- pieces
    def _system(self, rng: random.Random) -> list[dict[str, Any]]:
        if rng.random() < 0.2:
            return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS[self.domain])}]
        return []

    def _offer(self, rng: random.Random, needed: str | None) -> list[dict[str, Any]]:
        tools = [dict(t) for t in self.tools]
        if rng.random() >= 0.5 and len(tools) > 1:
            keep = rng.randint(1, len(tools))
            others = [t for t in tools if t["function"]["name"] != needed]
            chosen = rng.sample(others, keep - 1 if needed else keep)
            if needed:
                chosen += [t for t in tools if t["function"]["name"] == needed]
            tools = chosen
        rng.shuffle(tools)
        return tools

    def _continue(self, rng: random.Random) -> tuple[str, str] | None:
        if not self.with_lines:
            return None
        f = rng.choice(self.with_lines)
        lines = f.text.splitlines()
        for _ in range(8):
            n = rng.randint(3, 12)
            i = rng.randint(0, max(0, len(lines) - n - 2))
            snippet_lines = lines[i: i + n]
            while snippet_lines and len("\n".join(snippet_lines)) > 600:
                snippet_lines.pop(0)
            snippet = "\n".join(snippet_lines)
            answer_lines: list[str] = []
            for line in lines[i + n: i + n + CONTINUE_LINES]:
                if len("\n".join(answer_lines + [line])) > ANSWER_CHARS:
                    break
                answer_lines.append(line)
            answer = "\n".join(answer_lines).rstrip()
            if (len(snippet.strip()) < 40 or not answer.strip() or _is_license(snippet + answer)
                    or "```" in snippet + answer):
                continue
            values = {"fence": f.fence, "snippet": snippet, "path": f.path, "base": f.path.rsplit("/", 1)[-1]}
            return _fmt(rng.choice(CONTINUE_REQUESTS), values), f"```{f.fence}\n{answer}\n```"
        return None

    def _explain(self, rng: random.Random) -> tuple[str, str] | None:
        if not self.with_explain:
            return None
        ex = rng.choice(rng.choice(self.with_explain).explains)
        return _fmt(rng.choice(EXPLAIN_QUESTIONS[ex.style]), ex.vars), ex.answer

    def _call(self, rng: random.Random) -> tuple[CallSpec, str, dict[str, Any]] | None:
        available = sorted(self.with_call)
        if not available:
            return None
        # tools grounded in few documents are asked for less often (sqrt of their document count)
        tool = rng.choices(available, [len(self.with_call[t]) ** 0.5 for t in available])[0]
        spec = rng.choice([c for c in rng.choice(self.with_call[tool]).calls if c.tool == tool])
        templates = REQUESTS[tool]
        if any("\n" in str(v) for v in spec.vars.values()):  # multi-line code only inside a code fence
            templates = [t for t in templates if "```" in t] or templates
        template = rng.choice(templates)
        args = dict(spec.arguments)
        for key, value in spec.optional.items():
            if "{" + key + "}" in template:
                args[key] = value
        return spec, _fmt(template, spec.vars), args

    # --- conversations
    def conversation(self, rng: random.Random, kind: str, index: int) -> dict[str, Any] | None:
        messages = self._system(rng)
        tools: list[dict[str, Any]] | None = None
        if kind in ("continue", "explain"):
            made = self._continue(rng) if kind == "continue" else self._explain(rng)
            if made is None:
                return None
            request, answer = made
            if rng.random() < TOOLS_ON_PLAIN_RATE:
                tools = self._offer(rng, None)
            messages += [{"role": "user", "content": request}, {"role": "assistant", "content": answer}]
        else:
            made_call = self._call(rng)
            if made_call is None:
                return None
            spec, request, args = made_call
            messages.append({"role": "user", "content": request})
            if kind == "notool":
                messages.append({"role": "assistant", "content": spec.direct})
            else:
                tools = self._offer(rng, spec.tool)
                call_id = f"call_{index}"
                messages += [
                    {"role": "assistant", "content": rng.choice(PREFACES) if rng.random() < 0.1 else None,
                     "tool_calls": [{"id": call_id, "type": "function",
                                     "function": {"name": spec.tool, "arguments": args}}]},
                    {"role": "tool", "tool_call_id": call_id, "name": spec.tool, "content": spec.result},
                    {"role": "assistant", "content": spec.answer},
                ]
        if len(render(messages, tools)) > MAX_RENDERED_CHARS:
            return None
        return {"messages": messages, "tools": tools, "kind": kind}

    def generate(self, n: int, rng: random.Random) -> Iterator[dict[str, Any]]:
        kinds = list(KIND_WEIGHTS)
        weights = [KIND_WEIGHTS[k] for k in kinds]
        made = failures = 0
        while made < n:
            kind = rng.choices(kinds, weights)[0]
            conv = self.conversation(rng, kind, made)
            if conv is None:
                failures += 1
                if failures > 50 * (made + 20):
                    log.warning("%s: gave up after %d conversations (%d failures)", self.domain, made, failures)
                    return
                continue
            made += 1
            yield conv


def load_pool(corpora: Path, domain: str, split: str, seed: int, max_docs: int = MAX_POOL_DOCS) -> list[dict[str, Any]]:
    """A deterministic subsample of a split's documents (at most `max_docs`, each truncated)."""
    docs = []
    for doc in iter_docs(corpora, domain, split):
        docs.append({"path": doc["path"], "text": doc["text"][:MAX_DOC_CHARS], "source": doc.get("source", "")})
    if len(docs) > max_docs:
        docs.sort(key=lambda d: zlib.crc32(f"{seed}:{d['path']}".encode()))
        docs = sorted(docs[:max_docs], key=lambda d: d["path"])
    return docs


def synthesize(domain: str, docs: list[dict[str, Any]], n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """`n` conversations from `docs` (deterministic in seed)."""
    synth = Synthesizer(domain, docs, seed)
    rng = random.Random(f"{seed}:{domain}:{split}")
    return list(synth.generate(n, rng))


def split_count(per_domain: int, split: str) -> int:
    return per_domain if split == "train" else max(1, round(per_domain * 0.05))


def cli(argv: list[str]) -> int:
    from tqdm import tqdm

    parser = argparse.ArgumentParser(prog="python -m specialists.train chat", description=__doc__.split("\n")[0])
    parser.add_argument("--corpora", type=Path, default=Path("data/corpora"))
    parser.add_argument("--out", type=Path, default=Path("data/chat"))
    parser.add_argument("--per-domain", type=int, default=20000, help="train conversations per domain")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--domains", nargs="*", default=list(DOMAINS))
    args = parser.parse_args(argv)

    summary: dict[str, dict[str, Any]] = {}
    for domain in args.domains:
        for split in SPLITS:
            docs = load_pool(args.corpora, domain, split, args.seed)
            n = split_count(args.per_domain, split)
            synth = Synthesizer(domain, docs, args.seed)
            rng = random.Random(f"{args.seed}:{domain}:{split}")
            out = args.out / domain / f"{split}.jsonl"
            out.parent.mkdir(parents=True, exist_ok=True)
            kinds: dict[str, int] = {}
            with out.open("w", encoding="utf-8") as f:
                for conv in tqdm(synth.generate(n, rng), total=n, desc=f"{domain}/{split}"):
                    kinds[conv["kind"]] = kinds.get(conv["kind"], 0) + 1
                    f.write(json.dumps(conv, ensure_ascii=False) + "\n")
            summary[f"{domain}/{split}"] = {"conversations": sum(kinds.values()), "kinds": kinds,
                                            "bytes": out.stat().st_size, **synth.counts()}
            log.info("%s/%s: %s", domain, split, summary[f"{domain}/{split}"])
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0
