"""Self-distillation data for a pretrained checkpoint's MTP drafter.

The checkpoint answers each prompt greedily with our own engine (batched, CUDA graphs on a GPU), the
way it will answer when it serves: the prompt rendered through the checkpoint's chat template with the
generation prompt. The conversations (prompt + reply, loss on the reply) and raw code text (the
interpreter's standard library, reserved evaluation sources excluded) are packed into the token
streams `python -m specialists.train mtp` reads (data.py), under <out>/<domain>/{train,validation}.
The validation split holds the replies to the held-out prompts. With --self-prompts N the model also
writes N user requests itself (Magpie: the template sampled up to the end of a user turn), checked
against the evaluation sets given to --decontaminate; 5% of them join the held-out split.

  python -m specialists.train distill --model CKPT --prompts data/general/prompts.jsonl \\
      --heldout data/general/prompts.heldout.jsonl --out data/packed_general [--domain general] \\
      [--max-new-tokens 320] [--code-tokens 3000000] [--device cuda --dtype bfloat16] \\
      [--self-prompts 10000 --decontaminate bench/data/general/*.jsonl]
"""

from __future__ import annotations

import argparse
import json
import logging
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specialists.train.pack import pack_text, read_jsonl
from specialists.train.sources import reserved_path_reason, reserved_text_reason, TEXT_HEADER_CHARS

log = logging.getLogger(__name__)

Example = tuple[list[int], list[int], bool]  # prompt ids, reply ids, ended with an end-of-turn token


def render_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the server renders a one-message chat, generation prompt included."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def generate(engine, tokenizer, prompts: list[str], max_new_tokens: int, chunk: int, desc: str) -> list[Example]:
    """Greedy replies, `chunk` requests in flight per engine.generate call."""
    from spec.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    out: list[Example] = []
    for start in tqdm(range(0, len(prompts), chunk), desc=desc, unit="chunk"):
        ids = [render_ids(tokenizer, p) for p in prompts[start:start + chunk]]
        for prompt_ids, result in zip(ids, engine.generate(ids, params)):
            out.append((prompt_ids, list(result.token_ids), result.finish_reason == "stop"))
    return out


def pre_query_ids(tokenizer) -> list[int]:
    """The chat template's tokens up to where a user message's text begins (system turn included)."""
    marker = "\u2063QUERY\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return tokenizer.encode(text[: text.index(marker)], add_special_tokens=False)


def row_text(row: dict) -> str:
    """An evaluation row's text: its prompt, or its messages' contents."""
    return row.get("prompt") or " ".join(str(m.get("content") or "") for m in row.get("messages", []))


def ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = text.lower().split()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def self_prompts(engine, tokenizer, count: int, seed: int, banned: set[tuple[str, ...]], chunk: int) -> list[str]:
    """User requests the chat model writes itself (Magpie): the template up to a user turn's text,
    sampled (temperature 0.9, top-p 0.95) to the end of that turn. Prompts that share an 8-word span with
    an evaluation set (`banned`), that are empty, cut off or repeated are dropped."""
    from spec.sampling import SamplingParams

    prefix = pre_query_ids(tokenizer)
    out, seen = [], set()
    for start in tqdm(range(0, count, chunk), desc="self prompts", unit="chunk"):
        params = [SamplingParams(max_tokens=96, temperature=0.9, top_p=0.95, seed=seed * 1_000_003 + i)
                  for i in range(start, min(count, start + chunk))]
        for result in engine.generate([list(prefix)] * len(params), params):
            text = tokenizer.decode(result.token_ids, skip_special_tokens=True).strip()
            if result.finish_reason != "stop" or len(text) < 12 or text in seen or ngrams(text) & banned:
                continue
            seen.add(text)
            out.append(text)
    return out


def pack_examples(examples: list[Example], eot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """chat [M] uint16, chat_mask [M] uint8 (1 on reply tokens), chat_starts [C] int64."""
    ids, mask, starts, total = [], [], [], 0
    for prompt, reply, _ in examples:
        starts.append(total)
        ids.append(np.asarray(prompt + reply + [eot], dtype=np.uint16))
        mask.append(np.asarray([0] * len(prompt) + [1] * len(reply) + [0], dtype=np.uint8))
        total += len(prompt) + len(reply) + 1
    return np.concatenate(ids), np.concatenate(mask), np.asarray(starts, dtype=np.int64)


def code_texts(max_chars: int) -> list[str]:
    """Python files of the interpreter's standard library (tests and reserved sources excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        if "test" in rel or "site-packages" in rel or reserved_path_reason(rel):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if reserved_text_reason(text[:TEXT_HEADER_CHARS]):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return texts


def write_split(folder: Path, text: np.ndarray, chat: tuple[np.ndarray, np.ndarray, np.ndarray]) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    for name, arr in zip(("text", "chat", "chat_mask", "chat_starts"), (text, *chat)):
        np.save(folder / f"{name}.npy", arr)
    return {"text_tokens": int(text.shape[0]), "chat_tokens": int(chat[0].shape[0]),
            "reply_tokens": int(chat[1].sum()), "conversations": int(chat[2].shape[0])}


def run(args: argparse.Namespace) -> dict:
    from specialists.engine import Engine

    started = time.monotonic()
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=getattr(torch, args.dtype),
                                    max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                    load_mtp=False)
    tok = engine.tokenizer
    if tok.vocab_size > np.iinfo(np.uint16).max:
        raise ValueError(f"vocabulary of {tok.vocab_size} does not fit the uint16 token streams")
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    train_rows, held_rows = read_jsonl(args.prompts)[: args.max_prompts], read_jsonl(args.heldout)
    chunk = args.max_num_seqs * 8
    if args.self_prompts:
        banned = set().union(*(ngrams(row_text(r)) for f in args.decontaminate for r in read_jsonl(f)))
        made = self_prompts(engine, tok, args.self_prompts, args.seed, banned, chunk)
        cut = len(made) // 20  # the first 5% (a seeded sample) is held out
        held_rows += [{"kind": "self", "prompt": p} for p in made[:cut]]
        train_rows += [{"kind": "self", "prompt": p} for p in made[cut:]]
        log.info("%d self prompts kept of %d sampled (%d evaluation 8-grams banned)", len(made), args.self_prompts, len(banned))
    train = generate(engine, tok, [r["prompt"] for r in train_rows], args.max_new_tokens, chunk, "train replies")
    held = generate(engine, tok, [r["prompt"] for r in held_rows], args.max_new_tokens, chunk, "held-out replies")
    gen_s = time.monotonic() - started
    code = pack_text(tok, code_texts(args.code_tokens * 4), args.code_tokens, eot)
    cut = max(len(code) // 20, 4096)
    base = args.out / args.domain
    summary = {"train": write_split(base / "train", code[cut:], pack_examples(train, eot)),
               "validation": write_split(base / "validation", code[:cut], pack_examples(held, eot))}
    with open(args.out / "replies.jsonl", "w", encoding="utf-8") as f:
        for row, (_, reply, ended) in zip(train_rows + held_rows, train + held):
            f.write(json.dumps({"kind": row.get("kind"), "prompt": row["prompt"], "reply": tok.decode(reply),
                                "ended": ended}) + "\n")
    reply_tokens = sum(len(r) for _, r, _ in train + held)
    summary.update(model=str(args.model), device=args.device, dtype=args.dtype, prompts=len(train_rows) + len(held_rows),
                   self_prompts=sum(r.get("kind") == "self" for r in train_rows + held_rows),
                   reply_tokens=reply_tokens, ended=round(sum(e for *_, e in train + held) / max(1, len(train + held)), 3),
                   generate_s=round(gen_s, 1), generate_tok_s=round(reply_tokens / max(gen_s, 1e-9), 1))
    (args.out / "distill.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m specialists.train distill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--heldout", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--domain", default="general")
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--code-tokens", type=int, default=3_000_000, help="raw code tokens packed beside the replies")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-prompts", type=int, default=None, help="use the first N rows of --prompts")
    p.add_argument("--self-prompts", type=int, default=0, help="also sample N user requests from the model itself (Magpie)")
    p.add_argument("--decontaminate", type=Path, nargs="*", default=[],
                   help="JSONL evaluation sets: self prompts sharing an 8-word span with one of their prompts are dropped")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(json.dumps(run(args)))
    return 0
