"""Facts for conversations from CMake modules, Makefiles and m4: questions, tool calls and grounded answers."""

from __future__ import annotations

import random
import re

from specialists.train.facts_common import CallSpec, DocFacts, Explain, _clip, _is_license, _sentences

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
