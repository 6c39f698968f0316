"""Instruction prompts for the general specialist's drafter, built offline from this machine.

The drafter of a pretrained chat model learns the model's own replies (self-distillation), so the
prompts only have to look like what users send. They come from four local sources, none of them an
evaluation set:
  * Debian package descriptions (`apt-cache dumpavail`): "what is X for", "compare", "install";
  * man-page summaries (`apropos .`): "how do I use X to ...";
  * Python's standard library (module docstrings read with `ast`, never imported): explanations and
    small programs, plus C++ / shell / CMake requests built from the same names;
  * hand-written general templates (writing, explaining, planning, arithmetic word problems) filled
    with topics from the package and man-page summaries.
Reserved evaluation sources (MT-Bench, HumanEval, BFCL, Boost, OpenCV, networkx, ECM, bash-completion)
are dropped by name and text. A seeded 5% of the prompts (by hash) is written to a held-out file.

  python -m specialists.train general-prompts --out data/general/prompts.jsonl [--n 8000] [--seed 0]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import logging
import random
import re
import subprocess
import sysconfig
from pathlib import Path

from specialists.train.sources import reserved_path_reason, reserved_text_reason

log = logging.getLogger(__name__)

HELD_OUT_PERCENT = 5
_WORD = re.compile(r"^[a-z0-9][a-z0-9.+-]{1,40}$")

PACKAGE_TEMPLATES = (
    "What is the Debian package {name} used for? It is described as: {desc}.",
    "I found a package called {name} ({desc}). Should I install it, and what would I use it for?",
    "Explain to a new Linux user what {name} does and give one example of using it.",
    "Write a short paragraph for a newsletter introducing {name}: {desc}.",
    "How is {name} ({desc}) different from {other} ({other_desc})?",
    "Summarize in three bullet points why someone would choose {name}.",
)
MAN_TEMPLATES = (
    "How do I use the `{name}` command? The manual says: {desc}.",
    "Give me a practical example of `{name}` ({desc}) on the command line, with an explanation.",
    "What options of `{name}` are most useful day to day?",
    "I need to {lower_desc}. Which command should I use and how?",
    "Write a shell script that uses `{name}` and explain each line.",
)
PYTHON_TEMPLATES = (
    "Explain what the Python module `{name}` is for ({desc}) and show a short example.",
    "Write a Python function that uses `{name}` and explain how it works.",
    "What are common mistakes when using Python's `{name}` module?",
    "Write unit tests with pytest for a small function that uses `{name}`.",
    "Rewrite this idea as idiomatic Python: {lower_desc}, using the `{name}` module.",
)
CODE_TEMPLATES = (
    "Write a C++ function that {task}, and explain the complexity.",
    "Write a Python function that {task}. Include a docstring and type hints.",
    "Write a bash script that {task_shell}.",
    "Write a CMakeLists.txt for a small C++ project named {proj} with one library and one test executable.",
    "Review this plan and point out problems: a program that {task}.",
)
CODE_TASKS = (
    "reverses the words of a sentence", "counts the frequency of each character in a string",
    "merges two sorted lists", "checks whether a string is a palindrome", "parses a CSV line into fields",
    "finds the longest common prefix of a list of strings", "computes the median of a list of numbers",
    "removes duplicates from a list while keeping order", "converts a Roman numeral to an integer",
    "rotates a matrix by 90 degrees", "validates an IPv4 address", "computes a running average",
    "groups words that are anagrams", "flattens a nested list", "finds the k largest elements",
    "implements a least-recently-used cache", "reads a file and prints its ten most common words",
    "formats a number of bytes as a human-readable size", "computes the edit distance of two strings",
    "splits a list into chunks of a given size", "checks whether parentheses are balanced",
)
SHELL_TASKS = (
    "backs up a directory into a dated tar archive", "lists the ten largest files under a directory",
    "renames every .jpeg file to .jpg", "counts lines of code per file extension",
    "waits until a host answers ping, then prints the time", "deletes log files older than 7 days",
    "prints the disk usage of each user's home directory", "checks that required commands are installed",
)
GENERAL_TEMPLATES = (
    "Write a short, friendly email to a colleague about {topic}.",
    "Explain {topic} to a ten-year-old.",
    "Give me five tips for getting started with {topic}.",
    "Write a haiku about {topic}.",
    "What are the pros and cons of {topic}?",
    "Write a two-paragraph story in which {topic} plays a central role.",
    "Plan a one-week study schedule to learn about {topic}.",
    "Summarize the history of {topic} in a few sentences.",
    "Draft a tweet announcing a workshop on {topic}.",
    "I have to give a five-minute talk on {topic}. Suggest an outline.",
    "List three questions an interviewer might ask about {topic}, with good answers.",
    "Translate the following sentence into French and explain the grammar: \"I am learning about {topic}.\"",
)
EVERYDAY_TOPICS = (
    "gardening", "saving money", "learning a language", "running a marathon", "baking bread", "public transport",
    "remote work", "birdwatching", "composting", "chess openings", "volcanoes", "the water cycle",
    "photosynthesis", "budget travel", "time management", "board games", "recycling", "sleep hygiene",
    "renewable energy", "ancient Rome", "jazz music", "coffee brewing", "first aid", "rainforests",
    "writing a CV", "job interviews", "meditation", "bicycle maintenance", "home insulation", "tides",
)


def _arith_prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(3, 60), rng.randint(2, 12), rng.randint(2, 9)
    return rng.choice((
        f"A shop sells pens at {b} euros each. Anna buys {a} pens and pays with {a * b + c * 5} euros. How much change does she get? Explain.",
        f"A train travels {a * 10} km in {b} hours. What is its average speed, and how long would {c * 100} km take?",
        f"If {a} workers build a wall in {b} days, how long would {a + c} workers take, assuming the same pace?",
        f"What is {a} percent of {b * 150}? Show the steps.",
    ))


def debian_descriptions(limit: int = 20000) -> list[tuple[str, str]]:
    """(package, one-line description) from the apt lists of this machine (empty without apt)."""
    try:
        out = subprocess.run(["apt-cache", "dumpavail"], capture_output=True, text=True, timeout=300).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows, name = [], None
    for line in out.splitlines():
        if line.startswith("Package: "):
            name = line[9:].strip()
        elif line.startswith(("Description: ", "Description-en: ")) and name:
            rows.append((name, line.split(": ", 1)[1].strip()))
            name = None
    return _clean(rows)[:limit]


def man_summaries() -> list[tuple[str, str]]:
    """(command, whatis line) of section-1 and -8 man pages (empty without man-db)."""
    try:
        out = subprocess.run(["apropos", "-s", "1,8", "."], capture_output=True, text=True, timeout=300).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = []
    for line in out.splitlines():
        head, _, desc = line.partition(" - ")
        name = head.split(" (")[0].strip()
        if desc:
            rows.append((name, desc.strip()))
    return _clean(rows)


def stdlib_modules() -> list[tuple[str, str]]:
    """(module, first docstring line) of the interpreter's stdlib, parsed, never imported."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/__init__.py")):
        name = path.stem if path.name != "__init__.py" else path.parent.name
        if name.startswith("_") or "test" in name:
            continue
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8", errors="replace")))
        except (SyntaxError, ValueError):
            continue
        if doc:
            rows.append((name, doc.strip().splitlines()[0].rstrip(".")))
    return _clean(rows)


def _clean(rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Unique names, plain descriptions, reserved evaluation sources dropped."""
    seen, out = set(), []
    for name, desc in rows:
        if name in seen or not _WORD.match(name.lower()) or not 8 <= len(desc) <= 160:
            continue
        if reserved_path_reason(name) or reserved_text_reason(f"{name} {desc}"):
            continue
        seen.add(name)
        out.append((name, desc.rstrip(".")))
    return out


def _fill(template: str, rng: random.Random, name: str, desc: str, others: list[tuple[str, str]]) -> str:
    other, other_desc = rng.choice(others)
    return template.format(name=name, desc=desc, lower_desc=desc[:1].lower() + desc[1:], other=other,
                           other_desc=other_desc)


def build_prompts(n: int, seed: int) -> list[dict]:
    """`n` prompts in a seeded mix: packages 25%, man pages 20%, stdlib 15%, code 15%, general 25%."""
    rng = random.Random(seed)
    debs, mans, mods = debian_descriptions(), man_summaries(), stdlib_modules()
    log.info("sources: %d package descriptions, %d man pages, %d stdlib modules", len(debs), len(mans), len(mods))
    topics = list(EVERYDAY_TOPICS) + [d.lower() for _, d in rng.sample(debs, min(200, len(debs)))]
    mix = [("package", 25, debs, PACKAGE_TEMPLATES), ("man", 20, mans, MAN_TEMPLATES),
           ("python", 15, mods, PYTHON_TEMPLATES)]
    rows: list[dict] = []
    for kind, share, source, templates in mix:
        for _ in range(n * share // 100 if source else 0):
            name, desc = rng.choice(source)
            rows.append({"kind": kind, "prompt": _fill(rng.choice(templates), rng, name, desc, source)})
    for _ in range(n * 15 // 100):
        rows.append({"kind": "code", "prompt": rng.choice(CODE_TEMPLATES).format(
            task=rng.choice(CODE_TASKS), task_shell=rng.choice(SHELL_TASKS), proj=f"proj{rng.randint(1, 99)}")})
    while len(rows) < n:
        prompt = (_arith_prompt(rng) if rng.random() < 0.2
                  else rng.choice(GENERAL_TEMPLATES).format(topic=rng.choice(topics)))
        rows.append({"kind": "general", "prompt": prompt})
    unique = list({r["prompt"]: r for r in rows}.values())
    rng.shuffle(unique)
    return unique


def held_out(prompt: str, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{prompt}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m specialists.train general-prompts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="train prompts (JSONL); the held-out split goes beside it")
    p.add_argument("--n", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rows = build_prompts(args.n, args.seed)
    train = [r for r in rows if not held_out(r["prompt"], args.seed)]
    test = [r for r in rows if held_out(r["prompt"], args.seed)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    heldout_path = args.out.with_name(args.out.stem + ".heldout.jsonl")
    for path, part in ((args.out, train), (heldout_path, test)):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    kinds = {k: sum(r["kind"] == k for r in train) for k in sorted({r["kind"] for r in rows})}
    print(json.dumps({"train": len(train), "heldout": len(test), "kinds": kinds, "out": str(args.out)}))
    return 0
