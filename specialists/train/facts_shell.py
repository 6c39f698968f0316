"""Facts for conversations from shell scripts and man pages: questions, tool calls and grounded answers."""

from __future__ import annotations

import random
import re

from specialists.train.facts_common import CallSpec, DocFacts, Explain, _clip, _is_license, _sentences

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
        _man_facts(facts, path, text, rng)
    else:
        _script_facts(facts, path, text, rng)
    return facts


def _man_facts(facts: DocFacts, path: str, text: str, rng: random.Random) -> None:
    """A man page: what it is (its NAME line), a man_page call, and a whatis run."""
    name, section = _man_name_section(path)
    secs = _man_sections(text)
    name_lines = " ".join(l.strip() for l in secs.get("NAME", []) if l.strip())
    m = re.match(r"^(.+?)\s+(?:\\?-|‐|—|–)+\s+(.+)$", name_lines)
    if not m:
        return
    names, desc = m.group(1).strip(), m.group(2).strip().rstrip(".")
    if not desc or len(desc) > 200:
        return
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


def _script_facts(facts: DocFacts, path: str, text: str, rng: random.Random) -> None:
    """A shell script: its header comment, and grep / wc / head runs over it."""
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
