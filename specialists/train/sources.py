"""Where the four domain corpora come from: source definitions and reserved-source exclusion.

A `Source` is one directory tree to walk for one domain.  Each file under it is offered to the
source's `classify` function, which names the source group the file belongs to (e.g. "libstdc++",
"stdlib", "cmake-modules", "scripts") or returns None to skip it.  Logical paths are relative to
`base`, so that a file looks the same whether it comes from this machine's `/` or from a Debian
package unpacked into a cache directory.

Reserved evaluation sources (Boost, OpenCV, networkx, ECM, bash-completion, HumanEval, MT-Bench,
BFCL) are recognised both by path component and by a mention near the top of the text.
"""

from __future__ import annotations

import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Mapping

Classifier = Callable[[Path, str], "str | None"]

HEADER_SUFFIXES: frozenset[str] = frozenset({".h", ".hpp", ".hh", ".hxx", ".tcc", ".ipp", ".inl"})
MAKEFILE_NAMES: frozenset[str] = frozenset(
    {"Makefile", "makefile", "GNUmakefile", "Makefile.am", "Makefile.in", "Makefile.in.in"}
)
SHELL_SHEBANG = re.compile(rb"^#![ \t]*(?:/usr)?(?:/local)?/bin/(?:env[ \t]+)?(?:sh|bash|dash|zsh|ksh|mksh)\b")
MAN_SECTIONS: frozenset[str] = frozenset({"man1", "man5", "man7", "man8"})

# Directory names never descended into, anywhere.
PRUNED_DIRS: frozenset[str] = frozenset(
    {"__pycache__", ".git", ".hg", ".svn", ".venv", "venv", "site-packages", "node_modules", ".tox"}
)

# Reserved evaluation sources: name -> pattern matched against each lower-cased path component.
RESERVED_COMPONENT_PATTERNS: Mapping[str, re.Pattern[str]] = MappingProxyType({
    "boost": re.compile(r"boost"),
    "opencv": re.compile(r"opencv"),
    "networkx": re.compile(r"networkx"),
    "ecm": re.compile(r"^ecm$|^ecm[a-z0-9_]*\.cmake$|extra[-_]cmake[-_]modules"),
    "bash-completion": re.compile(r"bash[-_]completion"),
    "humaneval": re.compile(r"human[-_]?eval"),
    "mt-bench": re.compile(r"mt[-_]?bench"),
    "bfcl": re.compile(r"bfcl|berkeley[-_]function[-_]call"),
})
# Reserved evaluation sources named in the text's header (license block, module docstring).
RESERVED_TEXT_PATTERNS: Mapping[str, re.Pattern[str]] = MappingProxyType({
    "boost": re.compile(r"boost software license|boost\.org/license|www\.boost\.org", re.I),
    "opencv": re.compile(r"opencv", re.I),
    "networkx": re.compile(r"networkx", re.I),
    "ecm": re.compile(r"extra[-_ ]cmake[-_ ]modules", re.I),
    "bash-completion": re.compile(r"bash[-_]completion", re.I),
    "humaneval": re.compile(r"human[-_ ]?eval\b", re.I),
    "mt-bench": re.compile(r"mt[-_]bench", re.I),
    "bfcl": re.compile(r"\bbfcl\b|berkeley function[- ]call", re.I),
})
TEXT_HEADER_CHARS = 4096

# Debian packages fetched with `apt-get download` + `dpkg -x` (never ECM or bash-completion).
DEBIAN_PACKAGES: tuple[str, ...] = (
    "autoconf",
    "autoconf-archive",
    "automake",
    "libtool",
    "gnulib",
    "autotools-dev",
    "gettext",
    "cmake-data",
    "zsh-common",
    "manpages",
    "bash-doc",
    "devscripts",
)

# Lower number = taken first when a split is capped by --max-mb.
GROUP_PRIORITY: Mapping[str, int] = MappingProxyType({
    "libstdc++": 0,
    "gcc-include": 0,
    "stdlib": 0,
    "cmake-modules": 0,
    "aclocal": 0,
    "autoconf": 0,
    "automake": 0,
    "m4": 0,
    "makefiles": 0,
    "gnulib-modules": 1,
    "python-config": 0,
    "scripts": 0,
    "zsh-completions": 0,
    "stdlib-tests": 2,
    "fish": 2,
})
DEFAULT_PRIORITY = 1


def group_priority(group: str) -> int:
    """Sampling priority of a source group (man pages and generic headers come after the core)."""
    if group.startswith("man"):
        return 1
    return GROUP_PRIORITY.get(group, DEFAULT_PRIORITY)


@dataclass(frozen=True)
class Source:
    """One directory tree walked for one domain."""

    domain: str
    root: Path
    base: Path
    classify: Classifier
    kind: str = "file"  # "file": read as text; "man": rendered with man(1)
    skip: tuple[str, ...] = field(default=())  # logical-path prefixes not descended into
    origin: str = "local"

    def describe(self) -> str:
        return f"{self.domain}:{self.origin}:{self.root}"


def reserved_path_reason(logical_path: str) -> str | None:
    """The reserved source a path belongs to (by any path component), or None."""
    for component in logical_path.lower().split("/"):
        for name, pattern in RESERVED_COMPONENT_PATTERNS.items():
            if pattern.search(component):
                return name
    return None


def reserved_text_reason(text: str) -> str | None:
    """The reserved source named in the text's header (first 4 KiB), or None."""
    head = text[:TEXT_HEADER_CHARS]
    for name, pattern in RESERVED_TEXT_PATTERNS.items():
        if pattern.search(head):
            return name
    return None


def read_head(path: Path, size: int = 256) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read(size)
    except OSError:
        return b""


# ---------------------------------------------------------------- classifiers


def classify_libstdcxx(path: Path, rel: str) -> str | None:
    return "libstdc++" if path.suffix in HEADER_SUFFIXES or path.suffix == "" else None


def classify_gcc_include(path: Path, rel: str) -> str | None:
    return "gcc-include" if path.suffix in HEADER_SUFFIXES else None


def classify_header(path: Path, rel: str) -> str | None:
    return "headers" if path.suffix in HEADER_SUFFIXES else None


def classify_stdlib(path: Path, rel: str) -> str | None:
    if path.suffix != ".py":
        return None
    parts = rel.split("/")
    return "stdlib-tests" if "test" in parts or "tests" in parts else "stdlib"


def classify_dist_packages(path: Path, rel: str) -> str | None:
    return "dist-packages" if path.suffix == ".py" else None


def classify_share_python(path: Path, rel: str) -> str | None:
    return "share-python" if path.suffix == ".py" else None


def classify_build(path: Path, rel: str) -> str | None:
    """CMake, Makefiles, m4/autotools files anywhere under the walked tree."""
    name, parts = path.name, rel.split("/")
    if path.suffix == ".cmake" or name == "CMakeLists.txt":
        return "cmake-modules" if any(p.startswith("cmake") for p in parts[:-1]) else "cmake-config"
    if name in MAKEFILE_NAMES or path.suffix in (".mk", ".make"):
        return "makefiles"
    if path.suffix == ".m4":
        if "aclocal" in rel:
            return "aclocal"
        return "autoconf" if "autoconf" in rel else "m4"
    if path.suffix == ".am" or name in ("configure.ac", "configure.in"):
        return "automake"
    if len(parts) >= 2 and parts[-2] == "modules" and "gnulib" in parts and "." not in name:
        return "gnulib-modules"
    return None


def classify_python_config(path: Path, rel: str) -> str | None:
    return "python-config" if path.name.startswith("Makefile") or path.suffix in (".mk", ".sh") else None


def classify_shell(path: Path, rel: str) -> str | None:
    """Shell scripts (by *.sh or shebang), zsh functions/completions and fish completions."""
    parts = rel.split("/")
    if "zsh" in parts[:-1] and path.suffix not in (".zwc", ".gz"):
        return "zsh-completions"
    if "fish" in parts[:-1]:
        return "fish" if path.suffix == ".fish" else None
    if "man" in parts[:-1] or path.suffix in (".gz", ".xz", ".bz2", ".zst"):
        return None
    if path.suffix == ".sh":
        return "scripts"
    return "scripts" if SHELL_SHEBANG.match(read_head(path, 128)) else None


def classify_man(path: Path, rel: str) -> str | None:
    """English man pages of sections 1, 5, 7, 8 (`man/man1/ls.1.gz`)."""
    parts = rel.split("/")
    if len(parts) != 3 or parts[0] != "man" or parts[1] not in MAN_SECTIONS:
        return None
    return parts[1] if re.search(r"\.\d\w*(\.gz)?$", path.name) else None


# ---------------------------------------------------------------- standard sources


def _dirs(sysroot: Path, pattern: str) -> list[Path]:
    return sorted(p for p in sysroot.glob(pattern) if p.is_dir() and not p.is_symlink())


def standard_sources(sysroot: Path, domain: str, origin: str = "local") -> list[Source]:
    """The sources of `domain` found under a filesystem root (`/`, a deb unpack dir or a fixture)."""
    builders: dict[str, Callable[[Path, str], list[Source]]] = {
        "cpp": _cpp_sources,
        "python": _python_sources,
        "build": _build_sources,
        "shell": _shell_sources,
    }
    return builders[domain](sysroot, origin)


def _cpp_sources(sysroot: Path, origin: str) -> list[Source]:
    out = [Source("cpp", d, sysroot, classify_libstdcxx, origin=origin) for d in _dirs(sysroot, "usr/include/c++/*")]
    out += [Source("cpp", d, sysroot, classify_gcc_include, origin=origin) for d in _dirs(sysroot, "usr/lib/gcc/*/*/include")]
    out += [
        Source("cpp", d, sysroot, classify_header, skip=("usr/include/c++",), origin=origin)
        for d in _dirs(sysroot, "usr/include") + _dirs(sysroot, "usr/local/include")
    ]
    return out


def _python_sources(sysroot: Path, origin: str) -> list[Source]:
    out = [
        Source("python", d, sysroot / "usr", classify_stdlib, skip=_python_skips(d, sysroot / "usr"), origin=origin)
        for d in _dirs(sysroot, "usr/lib/python3.*")
    ]
    out += [
        Source("python", d, sysroot, classify_dist_packages, origin=origin)
        for d in _dirs(sysroot, "usr/lib/python3/dist-packages") + _dirs(sysroot, "usr/local/lib/python3*/dist-packages")
    ]
    out += [Source("python", d, sysroot, classify_share_python, skip=("usr/share/man",), origin=origin) for d in _dirs(sysroot, "usr/share")]
    return out


def _python_skips(stdlib: Path, base: Path) -> tuple[str, ...]:
    rel = stdlib.relative_to(base).as_posix()
    return (f"{rel}/dist-packages", f"{rel}/site-packages")


def _build_sources(sysroot: Path, origin: str) -> list[Source]:
    roots = _dirs(sysroot, "usr/share") + _dirs(sysroot, "usr/lib") + _dirs(sysroot, "usr/src")
    return [Source("build", d, sysroot, classify_build, skip=("usr/share/man",), origin=origin) for d in roots]


def _shell_sources(sysroot: Path, origin: str) -> list[Source]:
    roots: list[Path] = []
    for pattern in ("usr/bin", "usr/sbin", "usr/libexec", "usr/lib", "usr/share", "etc", "usr/local/bin", "usr/local/sbin"):
        roots += _dirs(sysroot, pattern)
    out = [Source("shell", d, sysroot, classify_shell, skip=("usr/share/man",), origin=origin) for d in roots]
    out += [Source("shell", d, sysroot / "usr/share", classify_man, kind="man", origin=origin) for d in _dirs(sysroot, "usr/share/man")]
    return out


def interpreter_sources(domains: tuple[str, ...]) -> list[Source]:
    """The running interpreter's standard library (python) and its config dir Makefile (build)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    base = stdlib.parent.parent  # -> "lib/python3.11/..."
    out: list[Source] = []
    if "python" in domains and stdlib.is_dir():
        out.append(Source("python", stdlib, base, classify_stdlib, skip=_python_skips(stdlib, base), origin="interpreter"))
    libpl = sysconfig.get_config_var("LIBPL")
    if "build" in domains and libpl and Path(libpl).is_dir() and Path(libpl).is_relative_to(base):
        out.append(Source("build", Path(libpl), base, classify_python_config, origin="interpreter"))
    return out


def excluded_prefixes(repo_root: Path) -> tuple[Path, ...]:
    """Trees never read from: this repository, /work, and the active virtualenv."""
    prefixes = {repo_root.resolve(), Path("/work")}
    if sys.prefix != sys.base_prefix:
        prefixes.add(Path(sys.prefix).resolve())
    return tuple(sorted(prefixes))
