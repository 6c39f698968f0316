"""Tokenize the corpora and the conversations of each domain into packed token streams.

`python -m specialists.train pack --corpora data/corpora --chat data/chat --tokenizer data/tokenizer
 --out data/packed [--max-text-tokens 6000000] [--domains cpp ...]` writes
<out>/<domain>/<split>/{text,chat,chat_mask,chat_starts}.npy (see data.py) and <out>/manifest.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from pathlib import Path

import numpy as np
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from specialists.train.domains import DOMAINS

log = logging.getLogger(__name__)
PACKED_SPLITS = ("train", "validation")


def pack_text(tokenizer: PreTrainedTokenizerBase, texts: list[str], max_tokens: int, eot: int) -> np.ndarray:
    out: list[np.ndarray] = []
    total = 0
    for start in tqdm(range(0, len(texts), 256), desc="text", unit="batch", leave=False):
        for ids in tokenizer(texts[start : start + 256], add_special_tokens=False)["input_ids"]:
            out.append(np.asarray(ids + [eot], dtype=np.uint16))
            total += len(ids) + 1
            if total >= max_tokens:
                return np.concatenate(out)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.uint16)


def pack_chat(tokenizer: PreTrainedTokenizerBase, rows: list[dict], max_tokens: int, eot: int) -> tuple[np.ndarray, ...]:
    from specialists.train.tokenizer import encode_conversation

    ids_all: list[np.ndarray] = []
    mask_all: list[np.ndarray] = []
    starts: list[int] = []
    total = 0
    for row in tqdm(rows, desc="chat", unit="conv", leave=False):
        ids, mask = encode_conversation(tokenizer, row["messages"], row.get("tools"))
        starts.append(total)
        ids_all.append(np.asarray(ids + [eot], dtype=np.uint16))
        mask_all.append(np.asarray(mask + [0], dtype=np.uint8))
        total += len(ids) + 1
        if total >= max_tokens:
            break
    if not ids_all:
        return np.zeros(0, np.uint16), np.zeros(0, np.uint8), np.zeros(0, np.int64)
    return np.concatenate(ids_all), np.concatenate(mask_all), np.asarray(starts, dtype=np.int64)


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def pack_domain(tokenizer: PreTrainedTokenizerBase, corpora: Path, chat: Path, out: Path, domain: str, max_text_tokens: int, max_chat_tokens: int) -> dict:
    from specialists.train.corpus import iter_documents

    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    summary: dict[str, dict] = {}
    for split in PACKED_SPLITS:
        scale = 1.0 if split == "train" else 0.05
        texts = [doc["text"] for doc in iter_documents(corpora, domain, split)]
        text = pack_text(tokenizer, texts, int(max_text_tokens * scale), eot)
        rows = read_jsonl(chat / domain / f"{split}.jsonl")
        chat_ids, chat_mask, chat_starts = pack_chat(tokenizer, rows, int(max_chat_tokens * scale), eot)
        folder = out / domain / split
        folder.mkdir(parents=True, exist_ok=True)
        for name, arr in (("text", text), ("chat", chat_ids), ("chat_mask", chat_mask), ("chat_starts", chat_starts)):
            np.save(folder / f"{name}.npy", arr)
        digest = hashlib.sha256(text.tobytes() + chat_ids.tobytes() + chat_mask.tobytes()).hexdigest()
        summary[split] = {"text_tokens": int(text.shape[0]), "chat_tokens": int(chat_ids.shape[0]), "conversations": int(chat_starts.shape[0]), "sha256": digest}
        log.info("%s/%s: %s", domain, split, summary[split])
    return summary


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m specialists.train pack", description=__doc__)
    parser.add_argument("--corpora", type=Path, default=Path("data/corpora"))
    parser.add_argument("--chat", type=Path, default=Path("data/chat"))
    parser.add_argument("--tokenizer", type=Path, default=Path("data/tokenizer"))
    parser.add_argument("--out", type=Path, default=Path("data/packed"))
    parser.add_argument("--domains", nargs="+", default=list(DOMAINS), choices=DOMAINS)
    parser.add_argument("--max-text-tokens", type=int, default=6_000_000, help="per domain, train split")
    parser.add_argument("--max-chat-tokens", type=int, default=5_000_000, help="per domain, train split")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    corpus_manifest = args.corpora / "manifest.json"
    manifest = {
        "tokenizer_sha256": hashlib.sha256((args.tokenizer / "tokenizer.json").read_bytes()).hexdigest(),
        "corpus_sha256": json.loads(corpus_manifest.read_text()).get("corpus_sha256") if corpus_manifest.exists() else None,
        "domains": {},
    }
    for domain in tqdm(args.domains, desc="pack", unit="domain"):
        manifest["domains"][domain] = pack_domain(tokenizer, args.corpora, args.chat, args.out, domain, args.max_text_tokens, args.max_chat_tokens)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps({"packed": str(args.out), **{d: v["train"] for d, v in manifest["domains"].items()}}))
    return 0
