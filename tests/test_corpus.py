"""Tests of the corpus builder (specialists/train/corpus.py): paths, splits, exclusion, dedupe, build."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from specialists.train import corpus
from specialists.train.corpus import Candidate, build_corpus, deduplicate, iter_documents, split_of, version_strip
from specialists.train.domains import DOMAINS, SPLITS
from specialists.train.sources import reserved_path_reason, reserved_text_reason


@pytest.mark.parametrize(
    ("path", "stripped"),
    [
        ("usr/include/c++/12/vector", "usr/include/c++/vector"),
        ("/usr/include/c++/13/bits/stl_vector.h", "usr/include/c++/bits/stl_vector.h"),
        ("lib/python3.11/json/x.py", "lib/python3/json/x.py"),
        ("usr/lib/python3.12/json/decoder.py", "usr/lib/python3/json/decoder.py"),
        ("usr/share/cmake-3.25/Modules/FindZLIB.cmake", "usr/share/cmake/Modules/FindZLIB.cmake"),
        ("usr/lib/gcc/x86_64-linux-gnu/12/include/x.h", "usr/lib/gcc/x86_64-linux-gnu/include/x.h"),
        ("usr/share/automake-1.16/am/lisp.am", "usr/share/automake/am/lisp.am"),
        ("usr/share/zsh/5.9/functions/_ls", "usr/share/zsh/functions/_ls"),
        ("usr/lib/llvm-14/include/llvm/ADT/APInt.h", "usr/lib/llvm/include/llvm/ADT/APInt.h"),
        ("man/man1/ls.1.gz", "man/man1/ls.1"),
        ("usr/include/x86_64-linux-gnu/bits/types.h", "usr/include/x86_64-linux-gnu/bits/types.h"),
        ("usr/bin/python3.11-config", "usr/bin/python3.11-config"),
    ],
)
def test_version_strip(path: str, stripped: str) -> None:
    assert version_strip(path) == stripped


def test_split_is_deterministic_and_roughly_90_5_5() -> None:
    paths = [f"usr/include/pkg{i % 97}/file_{i}.h" for i in range(20000)]
    counts = Counter(split_of(p) for p in paths)
    assert [split_of(p) for p in paths[:500]] == [split_of(p) for p in paths[:500]]
    assert set(counts) == set(SPLITS)
    assert 0.88 < counts["train"] / len(paths) < 0.92
    assert 0.04 < counts["validation"] / len(paths) < 0.06
    assert 0.04 < counts["test"] / len(paths) < 0.06


def test_same_file_under_two_versions_lands_in_same_split() -> None:
    for name in ("vector", "bits/stl_map.h", "bits/regex.tcc", "unordered_map", "format"):
        assert split_of(version_strip(f"usr/include/c++/12/{name}")) == split_of(version_strip(f"usr/include/c++/14/{name}"))
    for module in ("json/decoder.py", "asyncio/tasks.py", "os.py"):
        assert split_of(version_strip(f"lib/python3.11/{module}")) == split_of(version_strip(f"lib/python3.13/{module}"))


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("usr/include/boost/config.hpp", "boost"),
        ("usr/share/doc/libboost-filesystem1.74.0/copyright", "boost"),
        ("usr/share/cmake-3.25/Modules/FindBoost.cmake", "boost"),
        ("usr/include/opencv4/opencv2/core.hpp", "opencv"),
        ("usr/lib/python3/dist-packages/networkx/__init__.py", "networkx"),
        ("usr/share/ECM/modules/ECMAddTests.cmake", "ecm"),
        ("usr/share/extra-cmake-modules/find-modules/FindX.cmake", "ecm"),
        ("usr/share/bash-completion/completions/ls", "bash-completion"),
        ("etc/bash_completion.d/git", "bash-completion"),
        ("data/human_eval/problems.py", "humaneval"),
        ("data/HumanEval.jsonl", "humaneval"),
        ("x/mt_bench/q.json", "mt-bench"),
        ("x/bfcl/eval.py", "bfcl"),
        ("x/berkeley-function-call-leaderboard/a.py", "bfcl"),
    ],
)
def test_reserved_paths(path: str, reason: str) -> None:
    assert reserved_path_reason(path) == reason


@pytest.mark.parametrize(
    "path",
    ["usr/include/c++/12/vector", "lib/python3.11/filecmp.py", "usr/share/gnulib/m4/memcasecmp.m4", "usr/include/nss/secmod.h"],
)
def test_ordinary_paths_are_not_reserved(path: str) -> None:
    assert reserved_path_reason(path) is None


def test_reserved_license_header() -> None:
    boost = "//  Distributed under the Boost Software License, Version 1.0.\n#include <x>\n"
    assert reserved_text_reason(boost) == "boost"
    assert reserved_text_reason("# Copyright (C) 2000-2022, Intel Corporation, OpenCV Foundation\n") == "opencv"
    assert reserved_text_reason('"""NetworkX is a Python package for graphs."""\n') == "networkx"
    assert reserved_text_reason("// GNU General Public License v3\nint main() {}\n") is None


def _candidate(domain: str, path: str, text: str, group: str = "g") -> Candidate:
    return Candidate(domain, group, path, path, text, "local")


def test_dedupe_across_domains_first_sorted_path_wins() -> None:
    text = "#!/bin/sh\n# a tool\necho hello world from a script that is long enough\n"
    spaced = text.replace(" ", "   ").replace("\n", "\r\n\n")
    candidates = [
        _candidate("cpp", "usr/include/dup.h", text),
        _candidate("shell", "usr/bin/dup", spaced),
        _candidate("build", "usr/share/x/Makefile", "all:\n\techo unique content for the build domain here\n"),
    ]
    excluded: Counter[str] = Counter()
    kept = deduplicate(candidates, excluded)
    assert [(c.domain, c.path) for c in kept] == [("shell", "usr/bin/dup"), ("build", "usr/share/x/Makefile")]
    assert excluded["duplicate-content"] == 1


def test_decode_text_hygiene() -> None:
    assert corpus.decode_text(b"short")[1] == "too-small"
    assert corpus.decode_text(b"a\x00b" * 100)[1] == "binary"
    assert corpus.decode_text(b"\xff\xfe" * 100)[1] == "not-utf8"
    assert corpus.decode_text(b"x" * (corpus.MAX_BYTES + 1))[1] == "too-large"
    text, reason = corpus.decode_text(b"line one is here\r\nline two is here\r\nline three is here, long enough\r\n")
    assert reason == "" and text is not None and "\r" not in text


# ---------------------------------------------------------------- end to end


def _body(tag: str, lines: int = 6) -> str:
    return "".join(f"{tag} line {i}: some text that makes this file long enough to be kept\n" for i in range(lines))


FIXTURES: dict[str, str] = {
    # cpp
    "usr/include/c++/12/vector": "// libstdc++ vector\n" + _body("vector"),
    "usr/include/c++/12/bits/stl_vector.h": "// stl_vector\n" + _body("stl_vector"),
    "usr/lib/gcc/x86_64-linux-gnu/12/include/stddef.h": "/* stddef */\n" + _body("stddef"),
    "usr/include/stdio.h": "/* stdio */\n" + _body("stdio"),
    "usr/include/dup.h": "#!/bin/sh\n" + _body("duplicate"),
    "usr/include/boost/config.hpp": "// boost config\n" + _body("boost"),
    "usr/include/opencv4/opencv2/core.hpp": "// core\n" + _body("opencv"),
    "usr/include/licensed.h": "// Distributed under the Boost Software License, Version 1.0.\n" + _body("lic"),
    "usr/include/tiny.h": "int x;\n",
    # python
    "usr/lib/python3.11/json/decoder.py": '"""json decoder"""\n' + _body("decoder"),
    "usr/lib/python3/dist-packages/pkg/mod.py": '"""pkg"""\n' + _body("pkgmod"),
    "usr/lib/python3/dist-packages/networkx/__init__.py": '"""nx"""\n' + _body("nx"),
    "usr/lib/python3/dist-packages/pkg/__pycache__/mod.cpython-311.py": _body("cache"),
    "usr/lib/python3.11/site-packages/foo/bar.py": _body("site"),
    # build
    "usr/share/cmake-3.25/Modules/FindZLIB.cmake": "# FindZLIB\n" + _body("findzlib"),
    "usr/share/cmake-3.25/Modules/FindBoost.cmake": "# FindBoost\n" + _body("findboost"),
    "usr/share/ECM/modules/ECMAddTests.cmake": "# ECM\n" + _body("ecm"),
    "usr/share/aclocal/ax_foo.m4": "dnl ax_foo\n" + _body("axfoo"),
    "usr/share/doc/example/Makefile": "all:\n" + _body("\t@echo mk"),
    "usr/share/automake-1.16/am/lisp.am": "## lisp.am\n" + _body("lisp"),
    # shell
    "usr/bin/dup": "#!/bin/sh\n" + _body("duplicate"),
    "usr/bin/tool": "#!/bin/bash\n" + _body("echo tool"),
    "usr/bin/notascript": "#!/usr/bin/perl\n" + _body("print perl"),
    "usr/lib/foo/helper.sh": "# helper\n" + _body("echo helper"),
    "usr/share/zsh/vendor-completions/_tool": "#compdef tool\n" + _body("_arguments"),
    "usr/share/bash-completion/completions/tool.sh": "# completion\n" + _body("complete"),
    "etc/bash_completion.d/other.sh": "# completion\n" + _body("complete2"),
}
MAN_PAGE = ".TH TOOL 1\n.SH NAME\ntool \\- does things\n.SH DESCRIPTION\n" + "Tool does a great many useful things.\n" * 5
EXPECTED: dict[str, set[str]] = {
    "cpp": {
        "usr/include/c++/vector",
        "usr/include/c++/bits/stl_vector.h",
        "usr/lib/gcc/x86_64-linux-gnu/include/stddef.h",
        "usr/include/stdio.h",
    },
    "python": {"lib/python3/json/decoder.py", "usr/lib/python3/dist-packages/pkg/mod.py"},
    "build": {
        "usr/share/cmake/Modules/FindZLIB.cmake",
        "usr/share/aclocal/ax_foo.m4",
        "usr/share/doc/example/Makefile",
        "usr/share/automake/am/lisp.am",
    },
    "shell": {"usr/bin/dup", "usr/bin/tool", "usr/lib/foo/helper.sh", "usr/share/zsh/vendor-completions/_tool"},
}


def _make_tree(root: Path, with_man: bool) -> None:
    for rel, text in FIXTURES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    (root / "usr/include/binary.h").write_bytes(b"\x7fELF\x00\x00" * 40)
    if with_man:
        (root / "usr/share/man/man1").mkdir(parents=True)
        with gzip.open(root / "usr/share/man/man1/tool.1.gz", "wb") as handle:
            handle.write(MAN_PAGE.encode())


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object], bool]:
    tmp = tmp_path_factory.mktemp("corpus")
    with_man = corpus.man_command() is not None and shutil.which("col") is not None
    _make_tree(tmp / "root", with_man)
    roots = {d: [tmp / "root"] for d in DOMAINS}
    manifest = build_corpus(tmp / "out", roots=roots, use_debian=False, max_mb=40)
    return tmp / "out", manifest, with_man


def test_build_writes_expected_documents(built: tuple[Path, dict[str, object], bool]) -> None:
    out, _manifest, with_man = built
    for domain in DOMAINS:
        paths = {r["path"] for s in SPLITS for r in iter_documents(out, domain, s)}
        expected = EXPECTED[domain] | ({"man/man1/tool.1"} if with_man and domain == "shell" else set())
        assert paths == expected, domain


def test_build_rows_sorted_split_consistent_and_well_formed(built: tuple[Path, dict[str, object], bool]) -> None:
    out, _manifest, _ = built
    for domain in DOMAINS:
        for split in SPLITS:
            rows = list(iter_documents(out, domain, split))
            assert [r["path"] for r in rows] == sorted(r["path"] for r in rows)
            for row in rows:
                assert set(row) == {"path", "text", "source"}
                assert split_of(row["path"]) == split
                assert "\r" not in row["text"] and len(row["text"].encode()) >= corpus.MIN_BYTES


def test_build_manifest_counts_and_hashes(built: tuple[Path, dict[str, object], bool]) -> None:
    out, manifest, _ = built
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["corpus_sha256"] == manifest["corpus_sha256"]
    hashes = []
    for domain in DOMAINS:
        for split in SPLITS:
            entry = on_disk["domains"][domain]["splits"][split]
            data = (out / domain / f"{split}.jsonl").read_bytes()
            rows = list(iter_documents(out, domain, split))
            assert entry["documents"] == len(rows)
            assert entry["bytes"] == sum(len(r["text"].encode()) for r in rows)
            assert entry["sha256"] == hashlib.sha256(data).hexdigest()
            hashes.append(f"{domain}/{split} {entry['sha256']}")
    assert on_disk["corpus_sha256"] == hashlib.sha256("\n".join(hashes).encode()).hexdigest()
    excluded = on_disk["excluded"]
    for reason in ("boost", "opencv", "networkx", "ecm", "bash-completion"):
        assert excluded.get(f"reserved-path:{reason}", 0) >= 1, reason
    assert excluded["reserved-text:boost"] == 1
    assert excluded["duplicate-content"] >= 1
    assert excluded["too-small"] >= 1
    assert on_disk["debian"] == {"requested": [], "used": {}, "failed": {}}


def test_build_is_deterministic(built: tuple[Path, dict[str, object], bool], tmp_path: Path) -> None:
    out, manifest, with_man = built
    _make_tree(tmp_path / "root", with_man)
    again = build_corpus(tmp_path / "out", roots={d: [tmp_path / "root"] for d in DOMAINS}, use_debian=False)
    assert again["corpus_sha256"] == manifest["corpus_sha256"]


def test_max_mb_caps_train_split(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for i in range(200):
        path = root / f"usr/include/lib{i}/h{i}.h"
        path.parent.mkdir(parents=True)
        path.write_text(f"/* header {i} */\n" + _body(f"h{i}", 20))
    cap_mb = 0.02
    manifest = build_corpus(tmp_path / "out", domains=["cpp"], roots={"cpp": [root]}, use_debian=False, max_mb=cap_mb)
    splits = manifest["domains"]["cpp"]["splits"]  # type: ignore[index]
    assert 0 < splits["train"]["bytes"] <= cap_mb * corpus.MB
    assert splits["train"]["documents"] < manifest["domains"]["cpp"]["available_documents"]["train"]  # type: ignore[index]
    assert set(manifest["domains"]) == {"cpp"}  # type: ignore[arg-type]


def test_cli_parses_options() -> None:
    args = corpus.parse_args(["--out", "x", "--domains", "cpp", "shell", "--max-mb", "5", "--no-debian"])
    assert args.out == "x" and args.domains == ["cpp", "shell"] and args.max_mb == 5.0 and args.no_debian
