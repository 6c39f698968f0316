"""The drafter's vocabulary: the most frequent tokens of a domain's training data.

The drafter's cost per draft token is dominated by its lm_head (V x d). Drafting over the N most
frequent tokens only makes that N/V of the cost; a target token outside the set is simply never
drafted (verification keeps decoding exact). Written beside the drafter as mtp_vocab.safetensors
(tensor "token_ids", int64, most frequent first) and read by the engine.

  python -m specialists.train draft-vocab --packed data/packed --domain cpp --out deploy/models/cpp [--size 2048]
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from specialists.models.draftvocab import MTP_VOCAB, read_draft_vocab  # noqa: F401  (read side: serving code)

log = logging.getLogger(__name__)


def token_counts(packed: Path, domain: str, vocab_size: int) -> np.ndarray:  # -> [V] int64
    counts = np.zeros(vocab_size, dtype=np.int64)
    split = packed / domain / "train"
    for name in tqdm(("text.npy", "chat.npy"), desc=f"{domain} token counts", unit="array"):
        arr = np.load(split / name, mmap_mode="r")
        for i in range(0, len(arr), 1 << 22):
            counts += np.bincount(np.asarray(arr[i:i + (1 << 22)]), minlength=vocab_size)[:vocab_size]
    return counts


def write_draft_vocab(counts: np.ndarray, size: int, out: Path) -> dict:
    order = np.argsort(-counts, kind="stable")[:size]
    save_file({"token_ids": torch.from_numpy(order.astype(np.int64))}, str(out / MTP_VOCAB),
              metadata={"format": "pt", "kind": "cantata-mtp-vocab"})
    coverage = float(counts[order].sum() / max(1, counts.sum()))
    return {"size": int(size), "coverage": round(coverage, 4)}


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m specialists.train draft-vocab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--packed", type=Path, required=True)
    p.add_argument("--domain", required=True)
    p.add_argument("--out", type=Path, required=True, help="the model dir (has config.json)")
    p.add_argument("--size", type=int, default=2048)
    args = p.parse_args(argv)
    vocab_size = json.loads((args.out / "config.json").read_text())["vocab_size"]
    if not 0 < args.size <= vocab_size:
        p.error(f"--size must be in 1..{vocab_size}")
    info = write_draft_vocab(token_counts(args.packed, args.domain, vocab_size), args.size, args.out)
    meta_path = args.out / "cantata.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        meta["draft_vocab"] = {**info, "packed": str(args.packed)}
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    log.info("%s: draft vocabulary of %d tokens covers %.1f%% of training tokens", args.out, info["size"], 100 * info["coverage"])
    print(json.dumps(info))
    return 0
