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
import ast
import json
import logging
import random
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from specialists.chat import render
from specialists.train.domains import DOMAINS, SPLITS
from specialists.train.tools import tools_for

log = logging.getLogger(__name__)

MAX_POOL_DOCS = 5000        # documents per domain/split considered (deterministic subsample)
MAX_DOC_CHARS = 120_000     # longer documents are truncated before extraction
MAX_RENDERED_CHARS = 3000   # ~1000 tokens: keeps every conversation inside the 1024-token context
ANSWER_CHARS = 420          # "continue" answers stay under ~150 tokens
KIND_WEIGHTS: dict[str, float] = {"continue": 0.25, "explain": 0.2, "tool": 0.35, "notool": 0.2}
TOOLS_ON_PLAIN_RATE = 0.3   # continue/explain rows that still offer tools
LICENSE_MARKERS = ("Copyright", "copyright", "License", "LICENSE", "WITHOUT ANY WARRANTY", "SPDX", "license")


def iter_docs(corpora: Path, domain: str, split: str) -> Iterator[dict[str, Any]]:
    """Documents of one corpus split ({"path", "text", "source"} dicts)."""
    try:
        from specialists.train.corpus import iter_documents
    except ImportError:  # corpus builder not available: read the JSONL directly
        path = Path(corpora) / domain / f"{split}.jsonl"
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)
        return
    yield from iter_documents(Path(corpora), domain, split)


# ------------------------------------------------------------------------------------------ extracted facts


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


# ----------------------------------------------------------------------------------------------------- C++

_CPP_SKIP_NAMES = {
    "if", "for", "while", "switch", "return", "sizeof", "decltype", "alignof", "noexcept", "static_assert",
    "defined", "requires", "operator", "catch", "throw", "alignas", "typeid", "new", "delete", "template",
}
_SCOPE_RE = re.compile(r"^\s*(?:template\s*<.*>\s*)?(?:class|struct|union|namespace)\s+(?:[A-Z_][A-Z0-9_]*(?:\([^)]*\))?\s+)*([A-Za-z_]\w*)")
_CLASS_RE = re.compile(r"^\s*(?:template\s*<.*>\s*)?(class|struct)\s+(?:_GLIBCXX\w*\s+|\w+_API\s+)?([A-Za-z_]\w*)")


def _cpp_header(path: str, text: str) -> str:
    m = re.search(r"@headername\{([^}]+)\}", text)
    if m:
        return m.group(1).split(",")[0].strip()
    m = re.search(r"(?:^|/)c\+\+/[^/]+/(.+)$", path)
    if m:
        return m.group(1)
    m = re.search(r"(?:^|/)include/(.+)$", path)
    return m.group(1) if m else path.rsplit("/", 1)[-1]


def _clean_comment(lines: list[str]) -> str:
    out: list[str] = []
    for raw in lines:
        line = raw.strip()
        line = re.sub(r"^(/\*\*?<?|\*/|///?<?|//!|\*)", "", line).strip()
        line = re.sub(r"\*/$", "", line).strip()
        if re.match(r"^[@\\](param|tparam|return|returns|throw|throws|pre|post|see|sa|note|since|ingroup|headername|file|deprecated|retval|relates|addtogroup|{|})\b", line):
            break
        line = re.sub(r"^[@\\]brief\s*", "", line)
        line = re.sub(r"[@\\][acep]\s+(\S+)", r"\1", line)
        line = re.sub(r"[@\\]\w+\s*", "", line)
        out.append(line)
    return re.sub(r"\s+", " ", " ".join(out)).strip()


def _strip_code(line: str) -> str:
    line = re.sub(r"//.*$", "", line)
    line = re.sub(r"'(?:\\.|[^'\\])'", "''", line)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', line)


def _cpp_decl_name(decl: str) -> tuple[str, str] | None:
    m = _CLASS_RE.match(decl)
    if m and "(" not in decl.split(m.group(2), 1)[0]:
        return m.group(1), m.group(2)
    if "operator" in decl or decl.startswith("#") or decl.startswith("typedef"):
        return None
    for m in re.finditer(r"([A-Za-z_~]\w*)\s*\(", decl):
        name = m.group(1)
        if name in _CPP_SKIP_NAMES or name.startswith("__attribute") or re.fullmatch(r"_?[A-Z][A-Z0-9_]*", name):
            continue
        return "function", name
    return None


@dataclass
class CppSymbol:
    qualified: str
    kind: str
    decl: str
    doc: str


def extract_cpp_symbols(path: str, text: str) -> list[CppSymbol]:
    lines = text.splitlines()
    scope: list[str | None] = []
    pending: str | None = None
    in_block = False
    comment: list[str] = []
    last_comment: list[str] = []
    last_comment_end = -10
    symbols: list[CppSymbol] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if in_block:
            comment.append(line)
            if "*/" in stripped:
                in_block = False
                last_comment, last_comment_end = comment, i
            i += 1
            continue
        if stripped.startswith("/*"):
            comment = [line]
            if "*/" in stripped[2:]:
                last_comment, last_comment_end = comment, i
            else:
                in_block = True
            i += 1
            continue
        if stripped.startswith("//"):
            if last_comment_end == i - 1 and last_comment and last_comment[0].strip().startswith("//"):
                last_comment = last_comment + [line]
            else:
                last_comment = [line]
            last_comment_end = i
            i += 1
            continue
        if stripped and last_comment_end >= i - 1 and last_comment and not stripped.startswith("#"):
            # declaration following a comment: gather up to ; or { (at most 4 lines)
            decl_lines = [stripped]
            k = i
            while not re.search(r"[;{]", _strip_code(decl_lines[-1])) and k + 1 < len(lines) and len(decl_lines) < 4:
                k += 1
                decl_lines.append(lines[k].strip())
            decl = " ".join(decl_lines)
            decl = re.split(r"(?<=[;{])", decl)[0].rstrip("{").strip()
            named = _cpp_decl_name(decl)
            doc = _clean_comment(last_comment)
            if named and doc and len(doc) >= 15 and not _is_license(doc):
                kind, name = named
                if not name.startswith("_") and not name.startswith("~"):
                    parts = [s for s in scope if s and not s.startswith("_")]
                    symbols.append(CppSymbol("::".join(parts + [name]), kind, re.sub(r"\s+", " ", decl)[:200], doc))
            last_comment = []
        # scope tracking
        code = _strip_code(line)
        m = _SCOPE_RE.match(code)
        if m and ";" not in code.split("{", 1)[0]:
            pending = m.group(1)
        for ch in code:
            if ch == "{":
                scope.append(pending)
                pending = None
            elif ch == "}":
                if scope:
                    scope.pop()
            elif ch == ";" and pending is not None and "{" not in code:
                pending = None
        i += 1
    return symbols


_CPP_BROKEN = "int main()\n{\n  return 0\n}\n"


def cpp_facts(path: str, text: str, rng: random.Random) -> DocFacts:
    facts = DocFacts(path, text, "cpp")
    header = _cpp_header(path, text)
    symbols = extract_cpp_symbols(path, text)
    rng.shuffle(symbols)
    for sym in symbols[:12]:
        what = "class" if sym.kind in ("class", "struct") else "function"
        facts.explains.append(Explain(f"cpp_{what}", {"symbol": sym.qualified, "header": header},
                                      _sentences(sym.doc, 2, 280)))
        result = json.dumps({"symbol": sym.qualified, "header": header, "declaration": sym.decl,
                             "doc": _sentences(sym.doc, 1, 200)}, ensure_ascii=False)
        facts.calls.append(CallSpec(
            "lookup_symbol", {"symbol": sym.qualified}, {"header": header},
            {"symbol": sym.qualified, "header": header}, result,
            answer=rng.choice([
                f"`{sym.qualified}` is declared in `<{header}>`:\n```cpp\n{sym.decl}\n```",
                f"Found it in <{header}>: `{sym.decl}`. {_sentences(sym.doc, 1, 160)}",
                f"Declaration (from <{header}>):\n```cpp\n{sym.decl}\n```\n{_sentences(sym.doc, 1, 160)}",
            ]),
            direct=f"`{sym.qualified}` is declared in `<{header}>` as:\n```cpp\n{sym.decl}\n```",
        ))
    std = rng.choice(["c++11", "c++14", "c++17", "c++20", "c++23"])
    internal = re.search(r"(^|/)(bits|detail|impl|debug|profile)/|_imp\.|\.tcc$|_fn_imps|/[^/]+/[^/]+/", header)
    if header and not internal:
        sym_line = ""
        classes = [s for s in symbols if s.kind in ("class", "struct") and "::" in s.qualified]
        if classes:
            sym_line = f"// uses {classes[0].qualified}\n"
        ok_code = f"#include <{header}>\n{sym_line}\nint main()\n{{\n  return 0;\n}}\n"
        facts.calls.append(CallSpec(
            "compile_snippet", {"code": ok_code, "std": std}, {},
            {"code": ok_code, "std": std, "header": header},
            json.dumps({"command": f"g++ -std={std} -fsyntax-only snippet.cpp", "exit_status": 0, "diagnostics": ""}),
            answer=rng.choice([f"It compiles cleanly with -std={std}: no diagnostics.",
                               f"No errors or warnings: `<{header}>` builds fine under {std}.",
                               "The snippet compiles without diagnostics."]),
            direct=f"Yes, that compiles with -std={std}: `<{header}>` is an installed header and `main` is well formed.",
        ))
        broken = f"#include <{header}>\n\n{_CPP_BROKEN}"
        line_no = broken.splitlines().index("  return 0") + 1
        diag = (f"snippet.cpp: In function 'int main()':\n"
                f"snippet.cpp:{line_no}:11: error: expected ';' before '}}' token")
        facts.calls.append(CallSpec(
            "compile_snippet", {"code": broken, "std": std}, {},
            {"code": broken, "std": std, "header": header},
            json.dumps({"command": f"g++ -std={std} -fsyntax-only snippet.cpp", "exit_status": 1, "diagnostics": diag}),
            answer=f"It fails: line {line_no} is missing a semicolon after `return 0`. Write `return 0;`.",
            direct=f"It will not compile: `return 0` on line {line_no} needs a trailing semicolon.",
        ))
    return facts


# -------------------------------------------------------------------------------------------------- Python

_SAFE_BUILTINS: dict[str, Any] = {
    "len": len, "sorted": sorted, "max": max, "min": min, "sum": sum, "range": range, "hex": hex, "bin": bin,
    "divmod": divmod, "abs": abs, "int": int, "str": str, "list": list, "reversed": reversed, "set": set,
    "round": round, "oct": oct, "ord": ord, "chr": chr, "any": any, "all": all, "enumerate": enumerate,
}


def _python_module(path: str) -> str:
    m = re.search(r"python3(?:\.\d+)?/(?:(?:site|dist)-packages/)?(.+)\.py$", path)
    rel = m.group(1) if m else re.sub(r"\.py$", "", path.rsplit("/", 1)[-1])
    rel = re.sub(r"/__init__$", "", rel)
    return rel.replace("/", ".")


def _python_expressions(names: list[str], numbers: list[int], strings: list[str],
                        rng: random.Random) -> list[str]:
    exprs: list[str] = []
    if names:
        n = rng.choice(names)
        picks = rng.sample(names, min(len(names), rng.randint(3, 5)))
        exprs += [
            f"len({n!r})", f"{n!r}.upper()", f"{n!r}.split('_')", f"sorted({picks!r})",
            f"max({picks!r}, key=len)", f"{n!r}.replace('_', ' ').title()", f"[s for s in {picks!r} if len(s) > {len(n) - 1}]",
            f"{n!r}[::-1]", f"sum(len(s) for s in {picks!r})", f"{n!r}.count({n[0]!r})",
        ]
    if len(numbers) >= 2:
        a, b = rng.sample(numbers, 2)
        b = b or 1
        exprs += [f"{a} + {b}", f"{a} * {b}", f"hex({a})", f"divmod({a}, {b})", f"{a} ** 2", f"bin({a})",
                  f"{a} // {b}", f"sum(range({min(abs(a), 1000)}))"]
    for s in strings[:3]:
        exprs += [f"len({s!r})", f"{s!r}.strip().lower()", f"{s!r}.split()"]
    rng.shuffle(exprs)
    return exprs


def _eval_safe(expr: str) -> str | None:
    try:
        value = eval(expr, {"__builtins__": _SAFE_BUILTINS}, {})  # noqa: S307 - generated from a fixed grammar
    except Exception:  # noqa: BLE001
        return None
    out = repr(value)
    return out if len(out) <= 200 else None


def python_facts(path: str, text: str, rng: random.Random) -> DocFacts:
    facts = DocFacts(path, text, "python")
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return facts
    module = _python_module(path)
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", module):
        return facts
    defs: list[tuple[str, str, str, str]] = []  # (qualified, kind, signature, doc)
    mdoc = ast.get_docstring(tree)
    if mdoc and not _is_license(mdoc[:300]):
        defs.append((module, "module", module, mdoc))
    names: list[str] = []
    for node in tree.body:
        items: list[tuple[ast.AST, str]] = [(node, module)]
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            items += [(sub, f"{module}.{node.name}") for sub in node.body]
        for item, prefix in items:
            if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if item.name.startswith("_"):
                continue
            if prefix == module:
                names.append(item.name)
            doc = ast.get_docstring(item)
            if not doc or len(doc) < 15:
                continue
            if isinstance(item, ast.ClassDef):
                sig, kind = f"class {item.name}", "class"
            else:
                try:
                    sig = f"{item.name}({ast.unparse(item.args)})"
                except Exception:  # noqa: BLE001
                    continue
                kind = "method" if prefix != module else "function"
            defs.append((f"{prefix}.{item.name}", kind, sig, doc))
    rng.shuffle(defs)
    for qual, kind, sig, doc in defs[:10]:
        first = _sentences(doc.split("\n\n")[0], 2, 260)
        facts.explains.append(Explain(f"py_{kind}", {"name": qual, "module": module}, first))
        body = "\n".join("    " + l for l in _clip("\n".join(doc.splitlines()[:12]), 500).splitlines())
        where = f"module {module}" if kind == "module" else f"{kind} {qual.rsplit('.', 1)[-1]} in {module}"
        result = f"Help on {where}:\n\n{sig}\n{body}"
        facts.calls.append(CallSpec(
            "pydoc", {"name": qual}, {}, {"name": qual, "module": module}, result,
            answer=rng.choice([f"`{sig}`: {first}", f"{first}\n\nSignature: `{sig}`",
                               f"According to its docstring: {first}"]),
            direct=f"`{qual}` ({kind}): {first}",
        ))
    numbers = sorted({int(m) for m in re.findall(r"(?<![\w.])(\d{1,5})(?![\w.])", text)} - {0, 1})
    strings = [s for s in re.findall(r"'([A-Za-z][A-Za-z _-]{3,24})'", text)][:20]
    exprs = _python_expressions([n for n in names if len(n) <= 30][:30], numbers[:40], strings, rng)
    made = 0
    for expr in exprs:
        value = _eval_safe(expr)
        if value is None:
            continue
        statement = rng.random() < 0.3
        code = f"result = {expr}\nprint(result)" if statement else expr
        shown = value if not statement else (eval(value, {"__builtins__": {}}) if value[:1] in "'\"" else value)  # noqa: S307
        shown = str(shown)
        facts.calls.append(CallSpec(
            "run_python", {"code": code}, {}, {"code": code}, shown,
            answer=rng.choice([f"It returns `{value}`.", f"The result is `{value}`.", f"Output: `{shown}`",
                               f"`{expr}` evaluates to `{value}`."]),
            direct=f"`{expr}` evaluates to `{value}`.",
        ))
        made += 1
        if made >= 4:
            break
    return facts


# --------------------------------------------------------------------------------------------------- build

_RST_RE = re.compile(r"#\[(=*)\[\.rst:\n(.*?)#?\]\1\]", re.S)


def _cmake_doc(text: str) -> tuple[str, str] | None:
    """(title, body) of a CMake module's .rst documentation block or leading comment block."""
    m = _RST_RE.search(text)
    if m:
        block = m.group(2)
    else:
        lead = []
        for line in text.splitlines():
            if line.startswith("#"):
                lead.append(line.lstrip("#").lstrip(" ") if not line.startswith("#.rst:") else "")
            elif line.strip():
                break
            else:
                lead.append("")
        block = "\n".join(lead)
        if _is_license(block[:400]):
            return None
    lines = block.strip("\n").splitlines()
    if len(lines) >= 2 and re.fullmatch(r"[-=^~]{3,}", lines[1].strip()):
        title, rest = lines[0].strip(), "\n".join(lines[2:])
    else:
        title, rest = "", "\n".join(lines)
    paras = [p for p in re.split(r"\n\s*\n", rest)
             if p.strip() and not p.strip().startswith((".. ", "::", "#")) and not re.match(r"^\s*\w+\(", p)
             and len(p.split()) >= 3]
    if not paras:
        return None
    return title, paras[0]


def _rst_plain(text: str) -> str:
    text = re.sub(r":\w+:`([^`<]*?)(?:\s*<[^>]*>)?`", r"\1", text)
    text = re.sub(r"`([^`<]+?)\s*<[^>]+>`__?", r"\1", text)
    return text.replace("``", "`")


def _make_targets(text: str) -> list[tuple[str, list[str], str]]:
    """(target, recipe lines, comment above) for explicit Makefile targets."""
    lines = text.splitlines()
    out: list[tuple[str, list[str], str]] = []
    for i, line in enumerate(lines):
        m = re.match(r"^([A-Za-z][\w.\-/]*)\s*:(?![=:])", line)
        if not m or "=" in line.split(":", 1)[0]:
            continue
        target = m.group(1)
        recipe: list[str] = []
        for nxt in lines[i + 1: i + 20]:
            if not nxt.startswith("\t"):
                break
            recipe.append(nxt.strip())
        comment: list[str] = []
        j = i - 1
        while j >= 0 and lines[j].startswith("#"):
            comment.insert(0, lines[j].lstrip("#").strip())
            j -= 1
        out.append((target, recipe, " ".join(comment).strip()))
    return out


def _m4_macros(text: str) -> list[tuple[str, str]]:
    """(macro, description) for AC_DEFUN/AU_DEFUN/m4_define preceded by a comment block."""
    lines = text.splitlines()
    out: list[tuple[str, str]] = []
    for i, line in enumerate(lines):
        m = re.match(r"^(?:AC_DEFUN|AC_DEFUN_ONCE|AU_DEFUN|m4_define)\(\[?([A-Za-z_]\w*)", line)
        if not m:
            continue
        comment: list[str] = []
        j = i - 1
        while j >= 0 and re.match(r"^(#|dnl)", lines[j]):
            comment.insert(0, re.sub(r"^(#|dnl)\s?", "", lines[j]))
            j -= 1
        body = [c for c in comment if c.strip() and not re.fullmatch(r"[-=\s]+", c) and not c.startswith(m.group(1))]
        desc = " ".join(c.strip() for c in body)
        if len(desc) >= 20 and not _is_license(desc):
            out.append((m.group(1), desc))
    return out


def _build_fence(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    if name.endswith(".m4") or name.endswith(".ac"):
        return "m4"
    if name.endswith(".cmake") or name == "CMakeLists.txt":
        return "cmake"
    if "akefile" in name or name.endswith(".mk"):
        return "make"
    return ""


def _cmake_log(target: str, build_dir: str, config: str | None, sources: list[str]) -> str:
    cfg = f" --config {config}" if config else ""
    head = f"$ cmake --build {build_dir} --target {target}{cfg}\n"
    if target == "install":
        return head + (f"[100%] Built target all\nInstall the project...\n-- Install configuration: \"{config or 'Release'}\"\n"
                       "-- Installing: /usr/local/lib/cmake")
    if target == "clean":
        return head.rstrip("\n")
    if target == "test":
        return head + "Running tests...\n100% tests passed, 0 tests failed out of 3"
    lines = []
    srcs = sources[:3] or [f"{target}.c"]
    for k, src in enumerate(srcs):
        pct = int(100 * (k + 1) / (len(srcs) + 1))
        lang = "CXX" if src.endswith((".cpp", ".cc", ".cxx")) else "C"
        lines.append(f"[{pct:3d}%] Building {lang} object CMakeFiles/{target}.dir/{src}.o")
    lines += [f"[100%] Linking C executable {target}", f"[100%] Built target {target}"]
    return head + "\n".join(lines)


def build_facts(path: str, text: str, rng: random.Random) -> DocFacts:
    fence = _build_fence(path)
    facts = DocFacts(path, text, fence)
    stem = re.sub(r"\.(cmake|m4)$", "", path.rsplit("/", 1)[-1])
    if fence == "cmake":
        doc = _cmake_doc(text)
        if doc:
            title, para = doc
            module = title if re.fullmatch(r"[A-Za-z][\w-]*", title or "") else stem
            plain = _sentences(_rst_plain(para), 2, 280)
            if len(plain) >= 20:
                facts.explains.append(Explain("cmake_module", {"module": module}, plain))
                result = _clip(f"{module}\n{'-' * len(module)}\n\n{_rst_plain(para).strip()}", 700)
                facts.calls.append(CallSpec(
                    "cmake_help", {"module": module}, {}, {"module": module}, result,
                    answer=rng.choice([f"{module}: {plain}", f"From the {module} docs: {plain}",
                                       f"`{module}` — {plain}"]),
                    direct=f"`{module}`: {plain}",
                ))
        targets = re.findall(r"add_(?:executable|library|custom_target)\(\s*([A-Za-z][\w.-]*)\s*([^)]*)\)", text)
        for name, rest in targets[:4]:
            if name in ("IMPORTED", "ALIAS") or "${" in name:
                continue
            sources = [s for s in rest.split() if re.search(r"\.(c|cc|cpp|cxx)$", s)]
            facts.calls.append(_cmake_call(name, sources, rng))
        if not targets and rng.random() < 0.35:
            facts.calls.append(_cmake_call(rng.choice(["all", "install", "test", "clean"]), [], rng))
    elif fence == "make":
        for target, recipe, comment in _make_targets(text)[:40]:
            if comment and len(comment) >= 15 and not _is_license(comment):
                facts.explains.append(Explain("make_target", {"target": target, "file": path}, _sentences(comment, 2, 240)))
        chosen = _make_targets(text)
        rng.shuffle(chosen)
        for target, recipe, _ in chosen[:4]:
            jobs = rng.choice([2, 4, 8, 16])
            echoed = [r for r in recipe if not r.startswith("@") and not r.startswith("-@")][:4]
            log_text = "\n".join(r[:160] for r in echoed) if echoed else f"make: Nothing to be done for '{target}'."
            facts.calls.append(CallSpec(
                "make_target", {"target": target}, {"jobs": jobs}, {"target": target, "jobs": str(jobs), "file": path},
                f"$ make {target}\n{log_text}\nexit status 0",
                answer=(f"`make {target}` finished (exit status 0)." if echoed
                        else f"`{target}` is already up to date; make had nothing to do."),
                direct=(f"Run `make {target}`; its recipe is:\n```make\n{chr(10).join(recipe[:4])}\n```" if recipe
                        else f"Run `make {target}` (it has no recipe of its own, only prerequisites)."),
            ))
    elif "/gnulib/modules/" in "/" + path:
        m = re.match(r"Description:\n(.+?)\n\n", text, re.S)
        if m and len(m.group(1).strip()) >= 10:
            facts.explains.append(Explain("gnulib_module", {"module": stem}, _sentences(m.group(1), 2, 240)))
    elif fence == "m4":
        for macro, desc in _m4_macros(text)[:8]:
            facts.explains.append(Explain("m4_macro", {"macro": macro, "file": path}, _sentences(desc, 2, 260)))
    return facts


def _cmake_call(target: str, sources: list[str], rng: random.Random) -> CallSpec:
    build_dir = rng.choice(["build", "build", "_build", "out/build", "cmake-build-release"])
    config = rng.choice(["Debug", "Release", "RelWithDebInfo", "MinSizeRel"])
    return CallSpec(
        "cmake_build", {"target": target}, {"build_dir": build_dir, "config": config},
        {"target": target, "build_dir": build_dir, "config": config},
        _cmake_log(target, build_dir, config, sources) + "\nexit status 0",
        answer=rng.choice([f"Target `{target}` built successfully.", f"Done: `{target}` is up to date in the build tree.",
                           f"The build of `{target}` succeeded (exit status 0)."]),
        direct=f"Run `cmake --build {build_dir} --target {target}` (add `--config {config}` for multi-config generators).",
    )


# --------------------------------------------------------------------------------------------------- shell

_MAN_HEADER_RE = re.compile(r"^[A-Z][A-Z0-9 _-]*$")


def _man_sections(text: str) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current: str | None = None
    for line in text.splitlines():
        if _MAN_HEADER_RE.match(line.rstrip()) and line.strip():
            current = line.strip()
            sections.setdefault(current, [])
        elif current:
            sections[current].append(line)
    return sections


def _man_name_section(path: str) -> tuple[str, int | None]:
    base = path.rsplit("/", 1)[-1]
    base = re.sub(r"\.(gz|bz2|xz)$", "", base)
    m = re.match(r"^(.+)\.(\d)\w*$", base)
    if m:
        return m.group(1), int(m.group(2))
    m = re.search(r"man(\d)", path)
    return base, int(m.group(1)) if m else None


def shell_facts(path: str, text: str, rng: random.Random) -> DocFacts:
    is_man = path.startswith("man/") or "/man/" in path or bool(re.search(r"/man\d/", path))
    facts = DocFacts(path, text, "text" if is_man else "sh")
    if is_man:
        name, section = _man_name_section(path)
        secs = _man_sections(text)
        name_lines = " ".join(l.strip() for l in secs.get("NAME", []) if l.strip())
        m = re.match(r"^(.+?)\s+(?:\\?-|‐|—|–)+\s+(.+)$", name_lines)
        if not m:
            return facts
        names, desc = m.group(1).strip(), m.group(2).strip().rstrip(".")
        if not desc or len(desc) > 200:
            return facts
        synopsis = [l.rstrip() for l in secs.get("SYNOPSIS", []) if l.strip()][:5]
        syn = "\n".join(re.sub(r"\s+", " ", l.strip()) for l in synopsis)
        facts.explains.append(Explain("man", {"name": name, "section": str(section or "")},
                                      f"`{name}` — {desc}."))
        sect = f"({section})" if section else ""
        result = f"{name.upper()}{sect}\n\nNAME\n  {names} - {desc}\n" + (f"\nSYNOPSIS\n  {syn.replace(chr(10), chr(10) + '  ')}" if syn else "")
        usage = f" Usage: `{synopsis[0].strip()}`" if synopsis and len(synopsis[0].strip()) < 100 else ""
        facts.calls.append(CallSpec(
            "man_page", {"name": name}, {"section": section} if section else {},
            {"name": name, "section": str(section or 1)}, _clip(result, 700),
            answer=rng.choice([f"`{name}`: {desc}.{usage}", f"{name}{sect} — {desc}.{usage}",
                               f"The manual describes `{name}` as: {desc}.{usage}"]),
            direct=f"`{name}` — {desc}.{usage}",
        ))
        whatis = f"{name} ({section or 1})".ljust(21) + f"- {desc}"
        cmd = rng.choice([f"whatis {name}", f"man -f {name}"])
        facts.calls.append(CallSpec(
            "run_shell", {"command": cmd}, {"timeout_s": rng.choice([5, 10, 30])}, {"command": cmd, "name": name, "timeout_s": "10"},
            whatis, answer=f"`{name}` — {desc}.", direct=f"`{cmd}` prints:\n```\n{whatis}\n```",
        ))
        return facts
    # shell script
    lines = text.splitlines()
    header: list[str] = []
    for line in lines[1 if lines and lines[0].startswith("#!") else 0:]:
        if line.startswith("#"):
            header.append(line.lstrip("#").strip())
        elif line.strip():
            break
        elif header:
            break
    desc = " ".join(h for h in header if h and not re.fullmatch(r"[-=#*\s]+", h))
    script = path.rsplit("/", 1)[-1]
    if len(desc) >= 20 and not _is_license(desc):
        facts.explains.append(Explain("script", {"script": script, "path": "/" + path.lstrip("/")}, _sentences(desc, 2, 260)))
    abspath = "/" + path.lstrip("/")
    words = re.findall(r"\b[A-Za-z_][A-Za-z0-9_]{3,20}\b", text)
    counts: dict[str, int] = {}
    for w in words:
        counts[w] = counts.get(w, 0) + 1
    rare = sorted(w for w, c in counts.items() if 1 <= c <= 4)
    timeout = rng.choice([5, 10, 30, 60])
    if rare:
        w = rng.choice(rare)
        hits = [f"{i + 1}:{l[:100]}" for i, l in enumerate(lines) if w in l][:5]
        cmd = f"grep -n {w} {abspath}"
        facts.calls.append(CallSpec(
            "run_shell", {"command": cmd}, {"timeout_s": timeout}, {"command": cmd, "word": w, "path": abspath, "timeout_s": str(timeout)},
            "\n".join(hits),
            answer=f"`{w}` appears on line{'s' if len(hits) > 1 else ''} {', '.join(h.split(':')[0] for h in hits)} of {script}.",
            direct=f"`{w}` appears on line{'s' if len(hits) > 1 else ''} {', '.join(h.split(':')[0] for h in hits)} of {script}.",
        ))
    n = len(lines)
    cmd = f"wc -l {abspath}"
    facts.calls.append(CallSpec(
        "run_shell", {"command": cmd}, {"timeout_s": timeout}, {"command": cmd, "path": abspath, "timeout_s": str(timeout)},
        f"{text.count(chr(10))} {abspath}",
        answer=f"{script} has {text.count(chr(10))} lines.", direct=f"{script} has {text.count(chr(10))} lines.",
    ))
    k = rng.choice([3, 5])
    cmd = f"head -n {k} {abspath}"
    head = "\n".join(l[:120] for l in lines[:k])
    facts.calls.append(CallSpec(
        "run_shell", {"command": cmd}, {"timeout_s": timeout}, {"command": cmd, "path": abspath, "timeout_s": str(timeout)},
        head, answer=f"The first {k} lines of {script}:\n```sh\n{head}\n```",
        direct=f"The first {k} lines of {script} are:\n```sh\n{head}\n```",
    ))
    return facts


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
