"""What a corpus document is and where it goes: the candidate record, text hygiene, version
stripping of paths, and the deterministic train/validation/test split."""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from specialists.train.sources import group_priority, reserved_text_reason

MIN_BYTES = 64
MAX_BYTES = 512 * 1024
SPLIT_FRACTIONS: Mapping[str, float] = MappingProxyType({"test": 0.05, "validation": 0.05, "train": 0.90})

_PURE_VERSION = re.compile(r"v?\d+(?:\.\d+)*(?:[-+~][0-9A-Za-z.+~]*)?")
_PYTHON_VERSION = re.compile(r"^(python|pypy)(\d)\.\d+")
_DOTTED_VERSION = re.compile(r"(?<=[A-Za-z+])[-_]?v?\d+(?:\.\d+)+(?=$|[-_])")
_DASH_NUMBER = re.compile(r"^([A-Za-z][A-Za-z+]*)-\d+$")
_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class Candidate:
    """One document before deduplication and splitting."""

    domain: str
    group: str
    path: str  # version-stripped
    logical: str
    text: str
    origin: str

    @property
    def priority(self) -> int:
        return group_priority(self.group)


# ---------------------------------------------------------------- paths and splits


def _strip_component(component: str) -> str:
    if _PURE_VERSION.fullmatch(component):
        return ""
    component = _PYTHON_VERSION.sub(r"\1\2", component)
    component = _DOTTED_VERSION.sub("", component)
    return _DASH_NUMBER.sub(r"\1", component)


def version_strip(path: str) -> str:
    """Remove version numbers from a path's directories (and a trailing .gz).

    `usr/include/c++/12/vector` -> `usr/include/c++/vector`,
    `lib/python3.11/json/x.py` -> `lib/python3/json/x.py`,
    `usr/share/cmake-3.25/Modules/FindZLIB.cmake` -> `usr/share/cmake/Modules/FindZLIB.cmake`.
    """
    parts = [p for p in path.replace("\\", "/").strip("/").split("/") if p not in ("", ".")]
    if not parts:
        return ""
    name = parts[-1][:-3] if parts[-1].endswith(".gz") else parts[-1]
    dirs = [s for s in (_strip_component(p) for p in parts[:-1]) if s]
    return "/".join([*dirs, name])


def _unit_hash(text: str, salt: str = "") -> float:
    digest = hashlib.sha256((salt + text).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of(stripped_path: str) -> str:
    """The split of a version-stripped path: test 5%, validation 5%, train 90%."""
    u = _unit_hash(stripped_path)
    if u < SPLIT_FRACTIONS["test"]:
        return "test"
    if u < SPLIT_FRACTIONS["test"] + SPLIT_FRACTIONS["validation"]:
        return "validation"
    return "train"


def _order_key(stripped_path: str) -> float:
    """Deterministic sampling order, independent of the split hash."""
    return _unit_hash(stripped_path, salt="order:")


def content_key(text: str) -> str:
    """sha256 of the whitespace-normalised text (dedupe key)."""
    return hashlib.sha256(_WHITESPACE.sub(" ", text).strip().encode("utf-8")).hexdigest()


# ---------------------------------------------------------------- text hygiene


def decode_text(raw: bytes) -> tuple[str | None, str]:
    """(text, "") for clean UTF-8 text with normalised line endings, else (None, reason)."""
    if b"\x00" in raw:
        return None, "binary"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not-utf8"
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    size = len(text.encode("utf-8"))
    if size < MIN_BYTES:
        return None, "too-small"
    if size > MAX_BYTES:
        return None, "too-large"
    return text, ""


def _accept_text(text: str | None, reason: str, excluded: Counter[str]) -> str | None:
    if text is None:
        excluded[reason] += 1
        return None
    reserved = reserved_text_reason(text)
    if reserved:
        excluded[f"reserved-text:{reserved}"] += 1
        return None
    return text
