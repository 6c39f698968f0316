"""Assemble a shippable specialist directory from a training run.

  python -m specialists.train export --run runs/cpp --tokenizer data/tokenizer --packed data/packed \
      --out deploy/models/cpp [--dtype bfloat16]

The directory is a standard Hugging Face checkpoint (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with the chat template) plus the MTP drafter beside it (mtp.safetensors,
mtp_config.json) and cantata.json: how it was made (corpus and data hashes, tokens seen, steps,
final losses and drafter metrics, device, commit).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from specialists.models.mtp import load_drafter, save_drafter
from specialists.provenance import git_commit

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MTP_KEYS = ("parameters", "k", "steps", "tokens_seen", "seconds", "final", "sanity", "beats_bigram", "lr", "seed",
            "init_from", "prior_steps", "prior_tokens_seen", "device", "batch_size", "seq_len")  # of mtp_result.json


def provenance(run: Path, packed: Path, domain: str) -> dict:
    backbone = json.loads((run / "backbone_result.json").read_text())
    mtp = json.loads((run / "mtp_result.json").read_text())
    manifest = json.loads((packed / "manifest.json").read_text())
    return {
        "domain": domain,
        "family": backbone["family"],
        "preset": backbone["preset"],
        "commit": git_commit(),
        "device": backbone["device"],
        "exported": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "corpus_sha256": manifest.get("corpus_sha256"),
        "tokenizer_sha256": manifest.get("tokenizer_sha256"),
        "packed": manifest["domains"][domain],
        "backbone": {k: backbone[k] for k in ("parameters", "steps", "tokens_seen", "seconds", "final", "batch_size", "seq_len", "lr", "seed",
                                              "init_from", "prior_steps", "prior_tokens_seen", "tokens_seen_total") if k in backbone},
        "mtp": {k: mtp[k] for k in MTP_KEYS if k in mtp},
    }


def export(run: Path, tokenizer_dir: Path, packed: Path, out: Path, dtype: torch.dtype) -> dict:
    domain = json.loads((run / "backbone_result.json").read_text())["domain"]
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(str(run / "backbone"), dtype=torch.float32)
    model.to(dtype).save_pretrained(str(out))
    # verbatim: save_pretrained would move the chat template out of tokenizer_config.json
    for name in TOKENIZER_FILES:
        shutil.copy2(tokenizer_dir / name, out / name)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    save_drafter(load_drafter(run / "backbone"), out, dtype=dtype)
    meta = provenance(run, packed, domain)
    meta["weights_sha256"] = {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in ("model.safetensors", "mtp.safetensors")}
    (out / "cantata.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m specialists.train export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, default=Path("data/tokenizer"))
    parser.add_argument("--packed", type=Path, default=Path("data/packed"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    meta = export(args.run, args.tokenizer, args.packed, args.out, getattr(torch, args.dtype))
    print(json.dumps({"exported": str(args.out), "domain": meta["domain"], "backbone": meta["backbone"]["final"], "mtp": meta["mtp"]["final"]}))
    return 0
