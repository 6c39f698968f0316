"""The `general` label's training data for the routing classifier, from prompt files.

The four domains' examples come from their corpora and synthetic conversations; `general` has no
corpus, only requests: instructions, chat, questions that are not about the four domains. This writes
them in the same layout router.train reads, beside the domains':
  <corpora>/general/{train,validation}.jsonl  documents of 8-24 requests, one per line (windows of
                                              them read like a pasted list of questions)
  <chat>/general/{train,validation}.jsonl     each request as a conversation (a third with a system prompt)

    python -m router.general_data --train A.jsonl [B.jsonl ...] --validation C.jsonl \\
        --corpora data/corpora --chat data/chat

Rows are {"prompt": ...}. Evaluation sets (MT-Bench, the domains' held-out prompts) never go here.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

LABEL = "general"
SYSTEMS = ("You are a helpful assistant.", "You are a friendly and knowledgeable assistant. Answer clearly.")


def read_prompts(paths: list[Path]) -> list[str]:
    out: list[str] = []
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip() and (text := str(json.loads(line).get("prompt") or "").strip()):
                out.append(text)
    return list(dict.fromkeys(out))


def documents(prompts: list[str], rng: random.Random) -> list[dict]:
    shuffled = list(prompts)
    rng.shuffle(shuffled)
    docs, i = [], 0
    while i < len(shuffled):
        n = rng.randint(8, 24)
        docs.append({"path": f"{LABEL}/{len(docs)}", "text": "\n".join(shuffled[i:i + n]) + "\n", "source": LABEL})
        i += n
    return docs


def conversations(prompts: list[str], rng: random.Random) -> list[dict]:
    out = []
    for p in prompts:
        messages = [{"role": "user", "content": p}]
        if rng.random() < 1 / 3:
            messages.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
        out.append({"kind": LABEL, "messages": messages})
    return out


def write(corpora: Path, chat: Path, split: str, prompts: list[str], seed: int) -> dict:
    rng = random.Random(f"{seed}:{split}")
    for root, rows in ((corpora, documents(prompts, rng)), (chat, conversations(prompts, rng))):
        (root / LABEL).mkdir(parents=True, exist_ok=True)
        (root / LABEL / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return {"prompts": len(prompts)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m router.general_data", description=__doc__.split("\n\n")[0])
    p.add_argument("--train", type=Path, nargs="+", required=True)
    p.add_argument("--validation", type=Path, nargs="+", required=True)
    p.add_argument("--corpora", type=Path, required=True)
    p.add_argument("--chat", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    summary = {split: write(args.corpora, args.chat, split, read_prompts(paths), args.seed)
               for split, paths in (("train", args.train), ("validation", args.validation))}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
