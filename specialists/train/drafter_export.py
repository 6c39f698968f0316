"""Ship the MTP drafter of a checkpoint that is not ours (an imported pretrained model), or a
retrained drafter into one of ours (--into).

  python -m specialists.train export-drafter --checkpoint CKPT --run RUN --distill DATA \\
      --out deploy/models/general [--dtype bfloat16]
  python -m specialists.train export-drafter --checkpoint CKPT --run RUN --distill DATA \\
      --into deploy/models/cpp --version v8 --note "..."

Copies the drafter (mtp.safetensors in --dtype, mtp_config.json) and its vocabulary
(mtp_vocab.safetensors) from CKPT into --out, with cantata.json: the base checkpoint it was trained
against (cantata_import.json: package and sha256s), the self-distillation data (distill.json), the
training record (RUN/mtp_result.json), the commit and the weights' sha256. The checkpoint's own
weights are not copied: they come from the import at run time. With --into, the drafter replaces the
one of a shipped model directory of ours: its cantata.json keeps the backbone's record and gets the
new drafter's (the earlier one under "mtp_before"), the data it was trained on, a version and a note.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from datetime import datetime, timezone
from pathlib import Path

import torch

from specialists.models.draftvocab import MTP_VOCAB
from specialists.models.mtp import MTP_CONFIG, MTP_WEIGHTS, load_drafter, save_drafter
from specialists.provenance import git_commit
from specialists.train.export import MTP_KEYS


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def export_drafter(checkpoint: Path, run: Path, distill: Path, out: Path, dtype: torch.dtype) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    save_drafter(load_drafter(checkpoint), out, dtype=dtype)
    if (checkpoint / MTP_VOCAB).is_file():
        shutil.copy2(checkpoint / MTP_VOCAB, out / MTP_VOCAB)
    base = _json(checkpoint / "cantata_import.json")
    mtp = _json(run / "mtp_result.json")
    meta = {
        "kind": "drafter",
        "base": {k: base.get(k) for k in ("package", "gguf_sha256", "wheel_sha256", "dtype", "model_type")},
        "commit": git_commit(),
        "exported": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "distill": _json(distill / "distill.json"),
        "mtp": {k: mtp[k] for k in MTP_KEYS if k in mtp},
        "weights_sha256": {name: hashlib.sha256((out / name).read_bytes()).hexdigest()
                           for name in (MTP_WEIGHTS, MTP_CONFIG, MTP_VOCAB) if (out / name).is_file()},
    }
    (out / "cantata.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _stored_dtype(path: Path) -> torch.dtype:
    """The dtype a shipped drafter's weights are stored in (bf16 when there is none yet)."""
    if not path.is_file():
        return torch.bfloat16
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[f.get_slice(next(iter(f.keys()))).get_dtype()]


def ship_into(checkpoint: Path, run: Path, distill: Path, into: Path, version: str, note: str) -> dict:
    """The drafter trained into `checkpoint` replaces `into`'s (same backbone, same draft vocabulary)."""
    meta = _json(into / "cantata.json")
    dtype = _stored_dtype(into / MTP_WEIGHTS)
    save_drafter(load_drafter(checkpoint), into, dtype=dtype)
    mtp = _json(run / "mtp_result.json")
    data = _json(distill / "grammar_distill.json") or _json(distill / "distill.json")
    meta.update(mtp_before=meta.get("mtp"), mtp={k: mtp[k] for k in MTP_KEYS if k in mtp},
                drafter_data={k: data.get(k) for k in ("train", "validation", "functions", "constrained", "free",
                                                       "reply_tokens", "seed") if k in data},
                drafter_commit=git_commit(), drafter_exported=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                version=version, note=f"{meta.get('note', '')}; {version}: {note}")
    meta.setdefault("weights_sha256", {})[MTP_WEIGHTS] = hashlib.sha256((into / MTP_WEIGHTS).read_bytes()).hexdigest()
    (into / "cantata.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m specialists.train export-drafter", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True, help="the checkpoint the drafter was trained into")
    p.add_argument("--run", type=Path, required=True, help="the mtp run folder (mtp_result.json)")
    p.add_argument("--distill", type=Path, required=True, help="the distill output (distill.json)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="a drafter-only directory (an imported checkpoint's)")
    where.add_argument("--into", type=Path, help="a shipped model directory of ours whose drafter this replaces")
    p.add_argument("--version", help="with --into: the model's new version (e.g. v8)")
    p.add_argument("--note", default="", help="with --into: what changed")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args(argv)
    if args.into is not None:
        if not args.version:
            p.error("--into needs --version")
        meta = ship_into(args.checkpoint, args.run, args.distill, args.into, args.version, args.note)
        print(json.dumps({"shipped": str(args.into), "mtp": meta["mtp"].get("final"), "version": meta["version"]}))
        return 0
    meta = export_drafter(args.checkpoint, args.run, args.distill, args.out, getattr(torch, args.dtype))
    print(json.dumps({"exported": str(args.out), "mtp": meta["mtp"].get("final"), "bytes": {
        p.name: p.stat().st_size for p in sorted(args.out.iterdir())}}))
    return 0
