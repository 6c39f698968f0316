"""Debian packages the corpus command downloads (`apt-get download`) and unpacks (`dpkg -x`) itself."""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger(__name__)


@dataclass
class DebianFetch:
    """What the Debian step used: package -> deb file, unpacked roots, failures."""

    used: dict[str, str] = field(default_factory=dict)
    roots: dict[str, Path] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)



def _run(cmd: Sequence[str], cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _download_deb(package: str, cache_dir: Path, updated: list[bool]) -> Path:
    existing = sorted(cache_dir.glob(f"{package}_*.deb"))
    if existing:
        return existing[-1]
    result = _run(["apt-get", "download", package], cwd=cache_dir)
    if result.returncode != 0 and not updated[0]:
        updated[0] = True
        logger.info("apt-get download %s failed; running apt-get update once", package)
        _run(["apt-get", "update"], timeout=900)
        result = _run(["apt-get", "download", package], cwd=cache_dir)
    debs = sorted(cache_dir.glob(f"{package}_*.deb"))
    if result.returncode != 0 or not debs:
        lines = (result.stderr or result.stdout).strip().splitlines()
        raise RuntimeError(lines[-1] if lines else "apt-get download failed")
    return debs[-1]


def _unpack_deb(deb: Path, target: Path) -> None:
    marker = target.with_name(target.name + ".unpacked")
    if target.is_dir() and marker.is_file() and marker.read_text() == deb.name:
        return
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    result = _run(["dpkg", "-x", str(deb), str(target)])
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip() or "dpkg -x failed")
    marker.write_text(deb.name)


def fetch_debian(packages: Sequence[str], cache_dir: Path) -> DebianFetch:
    """Download and unpack `packages` into `cache_dir`; failures are logged and recorded."""
    fetch = DebianFetch()
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        logger.warning("apt-get/dpkg not available: using local files only")
        fetch.failed = {p: "apt-get/dpkg not available" for p in packages}
        return fetch
    cache_dir.mkdir(parents=True, exist_ok=True)
    updated = [False]
    for package in tqdm(packages, desc="debian", unit="pkg"):
        try:
            deb = _download_deb(package, cache_dir, updated)
            target = cache_dir / "root" / package
            _unpack_deb(deb, target)
        except (RuntimeError, OSError, subprocess.SubprocessError) as error:
            logger.warning("Debian package %s unavailable (%s); continuing without it", package, error)
            fetch.failed[package] = str(error)
            continue
        fetch.used[package] = deb.name
        fetch.roots[package] = target
    return fetch
