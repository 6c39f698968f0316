"""Which commit made a result: one helper shared by the benchmarks (bench/), the specialists' export
(specialists/train/export.py) and the router's classifier training (router/train.py). Standard library
only, so every layer may import it."""

from __future__ import annotations

import os
import subprocess


def git_commit() -> str:
    """CANTATA_COMMIT when set (a GPU lease gets a copy of the tree whose .git may be stale), else
    HEAD's short hash, with "+dirty" when tracked files differ from it; "unknown" outside git."""
    if os.environ.get("CANTATA_COMMIT"):
        return os.environ["CANTATA_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], capture_output=True).returncode != 0
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
