"""The code's shape, checked by walking its source (DESIGN.md "Layout"):

* imports follow state <- spec <- specialists <- router; policies is a leaf that only specialists
  and router read; bench may import anything; serving code (everything outside specialists/train
  and bench) imports no training (specialists.train) and no bench code; Ray is imported only by
  router/app.py and specialists/deployment.py. Imports inside functions count too.
* the router's HTTP side (and the wire schemas) load neither torch nor Ray;
* no file over 400 lines, no function over 60.

Each rule has a self-check on synthetic source, so a walk that stopped seeing imports would fail.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("router", "specialists", "spec", "state", "policies", "bench")
RANK = {"state": 0, "spec": 1, "specialists": 2, "router": 3}  # a module may import its rank and below
POLICY_READERS = {"policies", "specialists", "router", "bench"}
RAY_ALLOWED = {"router/app.py", "specialists/deployment.py"}
TRAINING = "specialists/train/"
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60

PENDING_IMPORTS: set[tuple[str, str]] = set()  # (path, module): known breaks, each to be fixed (none today)
PENDING_SIZES: set[tuple[str, str | None]] = set()  # (path, function or None for the file): over the limits


def _module_name(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: str, source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in `source` (functions included); `from a import b` gives
    both "a" and "a.b" (b may be a module); relative imports are resolved against `path`."""
    package = _module_name(path).split(".")
    if not path.endswith("__init__.py"):
        package = package[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def _is_in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def import_breaks(path: str, source: str) -> list[tuple[str, str]]:
    """(imported name, why) for every import of `path` against the rules in the module docstring."""
    here = path.split("/")[0]
    breaks: list[tuple[str, str]] = []
    for line, name in imported_names(path, source):
        top = name.split(".")[0]
        why = None
        if top == "ray" and path not in RAY_ALLOWED:
            why = "Ray outside router/app.py and specialists/deployment.py"
        elif here == "bench" or top not in PACKAGES or top == here and not _is_in(name, "specialists.train"):
            continue
        elif top == "bench":
            why = "only bench imports bench"
        elif _is_in(name, "specialists.train") and not path.startswith(TRAINING):
            why = "serving code imports training"
        elif top == "policies" and here not in POLICY_READERS:
            why = "policies is read by specialists and router only"
        elif here == "policies" and top != "policies":
            why = "policies is a leaf"
        elif here in RANK and top in RANK and RANK[top] > RANK[here]:
            why = f"{here} imports {top}, against state <- spec <- specialists <- router"
        if why:
            breaks.append((name, f"{path}:{line}: {name}: {why}"))
    return breaks


def _sources(*packages: str) -> list[tuple[str, str]]:
    files = sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py") if ".venv" not in p.parts)
    return [(p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8")) for p in files]


@pytest.mark.parametrize("path,source,broken", [
    ("state/kv_cache.py", "import spec.stats", True),
    ("spec/speculator.py", "from state.kv_cache import KVCache", False),
    ("spec/stats.py", "def f():\n    from specialists import engine", True),
    ("spec/stats.py", "from policies.policy import SpeculationPolicy", True),
    ("policies/gate.py", "from spec.stats import SpecStats", True),
    ("specialists/engine.py", "from policies.gate import SpeculationGate", False),
    ("specialists/engine.py", "def f():\n    from .train import draftvocab", True),
    ("specialists/engine.py", "from specialists import train", True),
    ("router/tools.py", "from specialists.chat import render", False),
    ("router/service.py", "def f():\n    import specialists.train.export", True),
    ("specialists/train/loopexit.py", "def g():\n    from bench.chat_eval import generate", True),
    ("specialists/train/export.py", "from specialists.train.pack import read_jsonl", False),
    ("specialists/train/export.py", "from router.routing import Router", True),
    ("bench/chat_eval.py", "from specialists.train.hf_generate import generate", False),
    ("bench/decode.py", "import ray", True),
    ("specialists/serve_metrics.py", "def f():\n    from ray.serve import metrics", True),
    ("specialists/deployment.py", "def f():\n    from ray import serve", False),
    ("router/app.py", "from ray.serve.handle import DeploymentHandle", False),
])
def test_the_import_walk_sees_breaks(path: str, source: str, broken: bool) -> None:
    assert bool(import_breaks(path, source)) == broken, import_breaks(path, source)


def test_modules_import_along_the_layers() -> None:
    seen: set[tuple[str, str]] = set()
    breaks = []
    for path, source in _sources(*PACKAGES):
        for name, message in import_breaks(path, source):
            pending = {(p, m) for p, m in PENDING_IMPORTS if p == path and _is_in(name, m)}
            seen |= pending
            if not pending:
                breaks.append(message)
    assert not breaks, "\n".join(breaks)
    assert seen == PENDING_IMPORTS, f"fixed, remove from PENDING_IMPORTS: {sorted(PENDING_IMPORTS - seen)}"


def test_router_http_side_loads_neither_torch_nor_ray() -> None:
    """router/app.py builds the Serve app (it imports specialists.deployment, hence torch and Ray); the
    modules that handle requests must not."""
    code = ("import sys, router.http, router.service, router.admin, router.backends, specialists.wire; "
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


# ---- sizes -------------------------------------------------------------------------------------------


def size_breaks(path: str, source: str) -> list[tuple[str | None, str]]:
    """(function name or None for the file, message) for a file over 400 lines or a function (def line
    to last line, nested ones on their own too) over 60."""
    found: list[tuple[str | None, str]] = []
    lines = len(source.splitlines())
    if lines > MAX_FILE_LINES:
        found.append((None, f"{path}: {lines} lines > {MAX_FILE_LINES}"))
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                found.append((node.name, f"{path}:{node.lineno}: {node.name} is {n} lines > {MAX_FUNCTION_LINES}"))
    return found


def _function(lines: int) -> str:
    return "def f():\n" + "    x = 1\n" * (lines - 1)


@pytest.mark.parametrize("source,broken", [
    (_function(60), False),
    (_function(61), True),
    ("class A:\n    async " + _function(61).replace("\n", "\n    ", 60), True),
    ("x = 1\n" * 400, False),
    ("x = 1\n" * 401, True),
])
def test_the_size_check_sees_breaks(source: str, broken: bool) -> None:
    assert bool(size_breaks("router/x.py", source)) == broken


def test_files_and_functions_are_small() -> None:
    seen: set[tuple[str, str | None]] = set()
    breaks = []
    for path, source in _sources(*PACKAGES, "tests"):
        for name, message in size_breaks(path, source):
            if (path, name) in PENDING_SIZES:
                seen.add((path, name))
            else:
                breaks.append(message)
    assert not breaks, "\n".join(breaks)
    assert seen == PENDING_SIZES, f"fixed, remove from PENDING_SIZES: {sorted(PENDING_SIZES - seen)}"
