"""Facts for conversations from Python sources: questions, tool calls and grounded answers."""

from __future__ import annotations

import ast
import random
import re
from typing import Any

from specialists.train.facts_common import CallSpec, DocFacts, Explain, _clip, _is_license, _sentences

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
    defs, names = _python_defs(tree, module)
    _pydoc_calls(facts, defs, module, rng)
    _run_python_calls(facts, text, names, rng)
    return facts


def _python_defs(tree: ast.Module, module: str) -> tuple[list[tuple[str, str, str, str]], list[str]]:
    """The documented public definitions (qualified name, kind, signature, docstring), the module's
    own docstring first, and the names of the module's public top-level definitions."""
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
    return defs, names


def _pydoc_calls(facts: DocFacts, defs: list[tuple[str, str, str, str]], module: str, rng: random.Random) -> None:
    """Up to ten definitions (shuffled): a question each and a pydoc call each."""
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


def _run_python_calls(facts: DocFacts, text: str, names: list[str], rng: random.Random) -> None:
    """Up to four run_python calls of small expressions over the module's names, numbers and strings."""
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
