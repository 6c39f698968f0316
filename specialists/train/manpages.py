"""Man pages as text: find the renderer, pick at most a few pages per command family, render them
with a small thread pool."""

from __future__ import annotations

import gzip
import logging
import os
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from specialists.train.documents import Candidate, _accept_text, _order_key, decode_text, version_strip
from specialists.train.sources import Source

logger = logging.getLogger(__name__)

MAN_PER_FAMILY = 20



def man_command() -> list[str] | None:
    """The command that renders a roff file to text on stdout (before `col -bx`), if any."""
    if shutil.which("man"):
        return ["man", "-l"]
    if shutil.which("groff"):
        return ["groff", "-t", "-man", "-Tutf8", "-P-cbou", "-rLL=80n"]
    return None


def _man_raw_head(path: Path) -> bytes:
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as handle:
            return handle.read(256)
    except (OSError, EOFError):
        return b""


def render_man(path: Path, command: Sequence[str]) -> str | None:
    """Render one man page to plain 80-column text (None when it fails or is a `.so` link)."""
    if _man_raw_head(path).lstrip().startswith(b".so "):
        return None
    env = {k: v for k, v in os.environ.items() if k not in ("MAN_KEEP_FORMATTING", "MANPAGER", "PAGER")}
    env.update(MANWIDTH="80", LC_ALL="C.UTF-8", MANPAGER="cat", PAGER="cat")
    try:
        if command[0] == "groff":
            with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as handle:
                source = handle.read()
            rendered = subprocess.run([*command], input=source, capture_output=True, env=env, timeout=60)
        else:
            rendered = subprocess.run([*command, str(path)], capture_output=True, env=env, timeout=60)
        if rendered.returncode != 0 or not rendered.stdout:
            return None
        plain = subprocess.run(["col", "-bx"], input=rendered.stdout, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError, EOFError):
        return None
    return plain.stdout.decode("utf-8", errors="replace") if plain.returncode == 0 else None


def select_man_pages(pages: Sequence[tuple[Source, Path, str, str]], max_man: int) -> list[tuple[Source, Path, str, str]]:
    """At most `max_man` pages, one per stripped path, at most MAN_PER_FAMILY per command family."""
    by_path: dict[str, tuple[Source, Path, str, str]] = {}
    for page in sorted(pages, key=lambda p: (version_strip(p[2]), p[0].origin, p[2])):
        by_path.setdefault(version_strip(page[2]), page)
    families: Counter[tuple[str, str]] = Counter()
    chosen: list[tuple[Source, Path, str, str]] = []
    for stripped in sorted(by_path, key=_order_key):
        section, name = stripped.split("/")[-2:]
        family = (section, re.split(r"[-_.]", name)[0])
        if families[family] >= MAN_PER_FAMILY:
            continue
        families[family] += 1
        chosen.append(by_path[stripped])
        if len(chosen) >= max_man:
            break
    return chosen


def render_man_pages(pages: Sequence[tuple[Source, Path, str, str]], excluded: Counter[str], workers: int) -> list[Candidate]:
    """Render pages with a thread pool; return candidates in input order."""
    command = man_command()
    if command is None or shutil.which("col") is None:
        logger.warning("neither man nor groff (with col) available: skipping %d man pages", len(pages))
        return []
    out: list[Candidate] = []
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        rendered = pool.map(lambda page: render_man(page[1], command), pages)
        for (source, _path, rel, group), text in tqdm(zip(pages, rendered), total=len(pages), desc="render man", unit="page"):
            if text is None:
                excluded["man-render-failed"] += 1
                continue
            accepted = _accept_text(*decode_text(text.encode("utf-8")), excluded)
            if accepted is not None:
                out.append(Candidate(source.domain, group, version_strip(rel), rel, accepted, source.origin))
    return out
