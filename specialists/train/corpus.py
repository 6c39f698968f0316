"""Build the four domain corpora (cpp, python, build, shell) from files on this machine.

    python -m specialists.train corpus --out data/corpora [--domains cpp python ...]
                                       [--max-mb 40] [--no-debian] [--max-man 2500]

Sources are this machine's headers, Python sources, CMake/Make/m4 files, shell scripts and man
pages (rendered to text), plus Debian packages that the command downloads with `apt-get download`
and unpacks with `dpkg -x` into a cache directory (see `sources.DEBIAN_PACKAGES`).  Reserved
evaluation sources (Boost, OpenCV, networkx, ECM, bash-completion, HumanEval, MT-Bench, BFCL) are
excluded by path and by license/header text.

Documents are deduplicated by the sha256 of their whitespace-normalised text (first by sorted
path wins, across domains) and by version-stripped path, then split train/validation/test (90/5/5)
by the sha256 of the version-stripped path, so a file lands in the same split whatever version
directory it was found under.  Output:

    <out>/<domain>/<split>.jsonl   {"path": ..., "text": ..., "source": ...} per line, sorted by path
    <out>/manifest.json            per domain and split: documents, bytes, sha256; corpus_sha256
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from tqdm import tqdm

from specialists.train.debian import DebianFetch, fetch_debian
from specialists.train.documents import (
    MAX_BYTES,
    MIN_BYTES,
    SPLIT_FRACTIONS,
    Candidate,
    _accept_text,
    _order_key,
    content_key,
    decode_text,
    split_of,
    version_strip,
)
from specialists.train.domains import DOMAINS, SPLITS
from specialists.train.manpages import man_command, render_man_pages, select_man_pages
from specialists.train.sources import (
    DEBIAN_PACKAGES,
    PRUNED_DIRS,
    Source,
    excluded_prefixes,
    interpreter_sources,
    reserved_path_reason,
    standard_sources,
)

__all__ = [  # the corpus API; documents.py and manpages.py hold the pieces
    "MAX_BYTES", "MIN_BYTES", "SPLIT_FRACTIONS", "Candidate", "build_corpus", "cli", "content_key", "decode_text",
    "deduplicate", "iter_documents", "man_command", "parse_args", "split_of", "version_strip",
]

logger = logging.getLogger(__name__)

MB = 1_000_000
MIN_HELDOUT_DOCS = 300
DEFAULT_MAX_MAN = 2500
REPO_ROOT = Path(__file__).resolve().parents[2]



# ---------------------------------------------------------------- walking


def _under(path: Path, prefixes: Sequence[Path]) -> bool:
    return any(path == p or path.is_relative_to(p) for p in prefixes)


def walk_source(source: Source, excluded: Counter[str], bar: tqdm | None = None) -> Iterator[tuple[Path, str, str, int]]:
    """Yield (file, logical path, group, size) for files of `source` that pass the path checks."""
    stack = [source.root]
    while stack:
        directory = stack.pop()
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name, reverse=True)
        except OSError:
            continue
        for entry in entries:
            if entry.is_symlink():
                continue
            path = Path(entry.path)
            rel = path.relative_to(source.base).as_posix()
            if entry.is_dir(follow_symlinks=False):
                if entry.name not in PRUNED_DIRS and not any(rel == s or rel.startswith(s + "/") for s in source.skip):
                    stack.append(path)
                continue
            if not entry.is_file(follow_symlinks=False):
                continue
            if bar is not None:
                bar.update(1)
            group = source.classify(path, rel)
            if group is None:
                continue
            reserved = reserved_path_reason(rel)
            if reserved:
                excluded[f"reserved-path:{reserved}"] += 1
                continue
            size = entry.stat(follow_symlinks=False).st_size
            if size > MAX_BYTES * 2 and source.kind == "file":
                excluded["too-large"] += 1
                continue
            yield path, rel, group, size


def _read_candidate(source: Source, path: Path, rel: str, group: str, excluded: Counter[str]) -> Candidate | None:
    try:
        raw = path.read_bytes()
    except OSError:
        excluded["unreadable"] += 1
        return None
    text = _accept_text(*decode_text(raw), excluded)
    if text is None:
        return None
    return Candidate(source.domain, group, version_strip(rel), rel, text, source.origin)


def scan_files(sources: Sequence[Source], domain: str, excluded: Counter[str]) -> tuple[list[Candidate], list[tuple[Source, Path, str, str]]]:
    """Read the file sources of one domain; return text candidates and the man pages to render."""
    candidates: list[Candidate] = []
    man_pages: list[tuple[Source, Path, str, str]] = []
    with tqdm(desc=f"scan {domain}", unit="file", mininterval=1.0) as bar:
        for source in sources:
            for path, rel, group, _size in walk_source(source, excluded, bar):
                if source.kind == "man":
                    man_pages.append((source, path, rel, group))
                    continue
                candidate = _read_candidate(source, path, rel, group, excluded)
                if candidate is not None:
                    candidates.append(candidate)
    return candidates, man_pages


# ---------------------------------------------------------------- dedupe, split, cap


def deduplicate(candidates: Sequence[Candidate], excluded: Counter[str]) -> list[Candidate]:
    """Keep the first document per content hash and per stripped path, in sorted-path order."""
    domain_index = {d: i for i, d in enumerate(DOMAINS)}
    ordered = sorted(candidates, key=lambda c: (c.path, c.priority, domain_index.get(c.domain, 99), c.logical, c.origin))
    seen_content: set[str] = set()
    seen_path: set[str] = set()
    kept: list[Candidate] = []
    for candidate in ordered:
        key = content_key(candidate.text)
        if key in seen_content:
            excluded["duplicate-content"] += 1
            continue
        seen_content.add(key)
        if candidate.path in seen_path:
            excluded["duplicate-path"] += 1
            continue
        seen_path.add(candidate.path)
        kept.append(candidate)
    return kept


def _nbytes(candidate: Candidate) -> int:
    return len(candidate.text.encode("utf-8"))


def cap_split(docs: Sequence[Candidate], budget: float | None, min_docs: int = 0) -> list[Candidate]:
    """Deterministic sample under a byte budget, by (source priority, path hash) order."""
    if budget is None:
        return list(docs)
    chosen: list[Candidate] = []
    total = 0
    for doc in sorted(docs, key=lambda d: (d.priority, _order_key(d.path))):
        size = _nbytes(doc)
        if total + size <= budget or len(chosen) < min_docs:
            chosen.append(doc)
            total += size
    return chosen


def split_domain(docs: Sequence[Candidate], max_mb: float | None) -> dict[str, list[Candidate]]:
    """Split one domain's documents and cap each split (train by max_mb, held-out proportionally)."""
    by_split: dict[str, list[Candidate]] = {s: [] for s in SPLITS}
    for doc in docs:
        by_split[split_of(doc.path)].append(doc)
    train_budget = max_mb * MB if max_mb and max_mb > 0 else None
    out: dict[str, list[Candidate]] = {}
    for split in SPLITS:
        if split == "train" or train_budget is None:
            out[split] = cap_split(by_split[split], train_budget)
        else:
            budget = train_budget * SPLIT_FRACTIONS[split] / SPLIT_FRACTIONS["train"]
            out[split] = cap_split(by_split[split], budget, MIN_HELDOUT_DOCS)
        out[split].sort(key=lambda d: d.path)
    return out


# ---------------------------------------------------------------- output


def write_split(path: Path, docs: Sequence[Candidate]) -> dict[str, object]:
    """Write one split's jsonl atomically; return its documents, bytes and sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "wb") as handle:
        for doc in docs:
            line = (json.dumps({"path": doc.path, "text": doc.text, "source": doc.group}, ensure_ascii=False) + "\n").encode("utf-8")
            digest.update(line)
            handle.write(line)
    tmp.replace(path)
    return {"documents": len(docs), "bytes": sum(_nbytes(d) for d in docs), "sha256": digest.hexdigest()}


def corpus_hash(domains_manifest: Mapping[str, Mapping[str, object]]) -> str:
    lines = [f"{d}/{s} {domains_manifest[d]['splits'][s]['sha256']}" for d in domains_manifest for s in SPLITS]  # type: ignore[index]
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()


def iter_documents(corpus_dir: str | Path, domain: str, split: str) -> Iterator[dict[str, str]]:
    """Yield {"path", "text", "source"} dicts of one domain split of a built corpus."""
    with open(Path(corpus_dir) / domain / f"{split}.jsonl", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


# ---------------------------------------------------------------- the build


def gather_sources(domains: Sequence[str], roots: Mapping[str, Sequence[Path]] | None, debian: DebianFetch) -> list[Source]:
    """All sources: `roots` (domain -> filesystem roots) or `/` + the interpreter + unpacked debs."""
    sources: list[Source] = []
    for domain in domains:
        domain_roots = [Path("/")] if roots is None else [Path(r) for r in roots.get(domain, ())]
        for root in domain_roots:
            sources += standard_sources(root, domain)
        for package, root in debian.roots.items():
            sources += standard_sources(root, domain, origin=f"deb:{package}")
    if roots is None:
        sources += interpreter_sources(tuple(domains))
    return sources


def _allowed(source: Source, forbidden: Sequence[Path], allowed: Sequence[Path]) -> bool:
    root = source.root.resolve()
    return not _under(root, forbidden) or _under(root, allowed)


def build_corpus(
    out_dir: str | Path,
    domains: Sequence[str] = DOMAINS,
    max_mb: float | None = 40.0,
    roots: Mapping[str, Sequence[str | Path]] | None = None,
    use_debian: bool = True,
    cache_dir: str | Path | None = None,
    debian_packages: Sequence[str] = DEBIAN_PACKAGES,
    max_man: int = DEFAULT_MAX_MAN,
    workers: int = 2,
) -> dict[str, object]:
    """Build the corpora into `out_dir` and return the manifest (also written as manifest.json).

    `roots` maps a domain to filesystem roots standing in for `/` (tests use a fixture tree); when
    given, the interpreter's standard library is not added.
    """
    out = Path(out_dir)
    domains = tuple(d for d in DOMAINS if d in set(domains))
    cache = Path(cache_dir) if cache_dir is not None else Path("data/cache/debs")
    debian = fetch_debian(debian_packages, cache) if use_debian else DebianFetch()
    root_paths = None if roots is None else {d: [Path(r) for r in rs] for d, rs in roots.items()}
    sources = gather_sources(domains, root_paths, debian)
    forbidden = excluded_prefixes(REPO_ROOT)
    sources = [s for s in sources if _allowed(s, forbidden, [cache.resolve()])]
    excluded: Counter[str] = Counter()
    candidates: list[Candidate] = []
    for domain in domains:
        found, man_pages = scan_files([s for s in sources if s.domain == domain], domain, excluded)
        candidates += found
        if man_pages:
            chosen = select_man_pages(man_pages, max_man)
            excluded["man-not-selected"] += len(man_pages) - len(chosen)
            candidates += render_man_pages(chosen, excluded, workers)
        logger.info("%s: %d candidate documents", domain, sum(c.domain == domain for c in candidates))
    kept = deduplicate(candidates, excluded)
    manifest = _write_all(out, domains, kept, max_mb)
    manifest.update(
        max_mb=max_mb,
        max_man=max_man,
        roots=sorted({s.describe() for s in sources}),
        debian={"requested": list(debian_packages) if use_debian else [], "used": debian.used, "failed": debian.failed},
        excluded=dict(sorted(excluded.items())),
    )
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return manifest


def _write_all(out: Path, domains: Sequence[str], kept: Sequence[Candidate], max_mb: float | None) -> dict[str, object]:
    domains_manifest: dict[str, dict[str, object]] = {}
    for domain in domains:
        docs = [c for c in kept if c.domain == domain]
        splits = split_domain(docs, max_mb)
        available = Counter(split_of(d.path) for d in docs)
        domains_manifest[domain] = {
            "splits": {s: write_split(out / domain / f"{s}.jsonl", splits[s]) for s in SPLITS},
            "available_documents": {s: available[s] for s in SPLITS},
            "sources": dict(sorted(Counter(d.group for s in SPLITS for d in splits[s]).items())),
        }
    return {"format": 1, "corpus_sha256": corpus_hash(domains_manifest), "domains": domains_manifest}


def summary(manifest: Mapping[str, object], seconds: float) -> dict[str, object]:
    """A compact per-domain, per-split documents/MB summary of a manifest."""
    domains = manifest["domains"]
    assert isinstance(domains, dict)
    return {
        "corpus_sha256": manifest["corpus_sha256"],
        "seconds": round(seconds, 1),
        "domains": {
            d: {s: {"docs": v["splits"][s]["documents"], "mb": round(v["splits"][s]["bytes"] / MB, 2)} for s in SPLITS}
            for d, v in domains.items()
        },
    }


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m specialists.train corpus", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/corpora", help="output directory (default data/corpora)")
    parser.add_argument("--domains", nargs="+", choices=DOMAINS, default=list(DOMAINS))
    parser.add_argument("--max-mb", type=float, default=40.0, help="cap on each domain's train split in MB (0: none)")
    parser.add_argument("--no-debian", action="store_true", help="skip downloading Debian packages")
    parser.add_argument("--cache-dir", default="data/cache/debs", help="where .deb files are downloaded and unpacked")
    parser.add_argument("--max-man", type=int, default=DEFAULT_MAX_MAN, help="most man pages rendered")
    parser.add_argument("--workers", type=int, default=2, help="threads rendering man pages")
    return parser.parse_args(list(argv))


def cli(argv: list[str]) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    manifest = build_corpus(
        args.out,
        domains=args.domains,
        max_mb=args.max_mb,
        use_debian=not args.no_debian,
        cache_dir=args.cache_dir,
        max_man=args.max_man,
        workers=args.workers,
    )
    print(json.dumps(summary(manifest, time.monotonic() - start)))
    return 0
