"""Facts for conversations from C and C++ headers: questions, tool calls and grounded answers."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
import re

from specialists.train.facts_common import CallSpec, DocFacts, Explain, _is_license, _sentences

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
            symbol = _documented_symbol(lines, i, last_comment, scope)
            if symbol is not None:
                symbols.append(symbol)
            last_comment = []
        pending = _track_scope(_strip_code(line), scope, pending)
        i += 1
    return symbols


def _documented_symbol(lines: list[str], i: int, comment: list[str], scope: list[str | None]) -> CppSymbol | None:
    """The declaration starting at line `i` right after `comment`, gathered up to ; or { (at most 4
    lines), as a symbol in `scope` when it is named, public and documented."""
    decl_lines = [lines[i].strip()]
    k = i
    while not re.search(r"[;{]", _strip_code(decl_lines[-1])) and k + 1 < len(lines) and len(decl_lines) < 4:
        k += 1
        decl_lines.append(lines[k].strip())
    decl = " ".join(decl_lines)
    decl = re.split(r"(?<=[;{])", decl)[0].rstrip("{").strip()
    named = _cpp_decl_name(decl)
    doc = _clean_comment(comment)
    if named and doc and len(doc) >= 15 and not _is_license(doc):
        kind, name = named
        if not name.startswith("_") and not name.startswith("~"):
            parts = [s for s in scope if s and not s.startswith("_")]
            return CppSymbol("::".join(parts + [name]), kind, re.sub(r"\s+", " ", decl)[:200], doc)
    return None


def _track_scope(code: str, scope: list[str | None], pending: str | None) -> str | None:
    """Follow the braces of one line of code (comments and literals stripped): push the name of a
    class, struct, union or namespace it opens (None for other braces), pop on }; returns the name
    still waiting for its { (a declaration split over lines)."""
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
    return pending


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
