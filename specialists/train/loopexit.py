r"""Loop-exit training data: teach a specialist to close a turn it has started to repeat (cpp v7).

Greedy decoding of a 3.5M-parameter model falls into repetition loops; teacher-forced training never
visits those states (exposure bias), so the model has no learned behaviour there besides copying. The
`build` step writes conversations whose assistant turn is a looping prefix (loss 0) followed by the
turn's close ("```" if a code fence is open, then <|im_end|>; loss only on those tokens):
  * on-policy: the model's own non-terminating replies (the `generate` step) cut at the first repeated
    line / repeated token span, and one or two repeats later; "continue" replies also after 4 lines;
  * synthetic: reference answers cut at a random point where one line or a short token span is repeated.
They are interleaved (shuffled) with the conversations of an existing packed chat stream; its text
stream and validation split are copied unchanged.

  # 1. greedy replies of the model to fresh training prompts (CPU, float32)
  python -m specialists.train loop-exit generate --model v3/deploy/models/cpp \
      --chat data/chat_s2/cpp/train.jsonl --out data/loopexit/onpolicy.jsonl --continue 1400 --other 800
  # 2. the packed stream with the loop-exit conversations added
  python -m specialists.train loop-exit build --replies data/loopexit/onpolicy.jsonl \
      --chat data/chat_s2/cpp/train.jsonl --tokenizer data/tokenizer --packed data/packed_v2 \
      --out data/packed_exit --synthetic 2000 --onpolicy-repeats 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from tqdm import tqdm

from specialists.chat import EOS_TOKEN, TOOL_CALL_OPEN, render
from specialists.train.data import TokenStreams
from specialists.train.pack import read_jsonl
from specialists.train.tokenizer import encode_conversation, load_tokenizer

log = logging.getLogger(__name__)
FENCE = "```"
EOT_TOKEN = "<|endoftext|>"  # ends each conversation of a packed chat stream (as in pack.py)
Example = tuple[list[int], list[int]]  # (token ids, loss mask) of one conversation

# ---------------------------------------------------------------------------------------- generate


def first_user_turn(messages: Sequence[dict]) -> list[dict]:
    """The messages up to and including the first user message (the prompt of a conversation)."""
    return list(messages[: next(i for i, m in enumerate(messages) if m["role"] == "user") + 1])


def select_prompts(rows: list[dict], n_continue: int, n_other: int, seed: int) -> list[dict]:
    """`n_continue` "continue" rows and `n_other` "explain"/"notool" rows of a seeded shuffle, each with
    `prompt_messages` and its rendered `prompt`, shortest prompt first."""
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    chosen = ([r for r in rows if r["kind"] == "continue"][:n_continue]
              + [r for r in rows if r["kind"] in ("explain", "notool")][:n_other])
    for r in chosen:
        r["prompt_messages"] = first_user_turn(r["messages"])
        r["prompt"] = render(r["prompt_messages"], r.get("tools"), add_generation_prompt=True)
    chosen.sort(key=lambda r: len(r["prompt"]))
    return chosen


def reply_record(row: dict, reply: Any) -> dict:
    return {"kind": row["kind"], "messages": row["prompt_messages"], "tools": row.get("tools"),
            "reference": row["messages"][len(row["prompt_messages"])].get("content"),
            "reply": reply.text, "ended": reply.ended}


def generate_replies(model_dir: Path, rows: list[dict], out: Path, max_new_tokens: int, batch_size: int,
                     chunk: int) -> int:
    """Greedy replies (float32, CPU) to the selected rows, appended to `out` `chunk` rows at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specialists.train.hf_generate import generate

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    unfinished = 0
    with open(out, "w", encoding="utf-8") as f:
        for start in tqdm(range(0, len(rows), chunk), desc="on-policy replies", unit="chunk"):
            part = rows[start: start + chunk]
            replies = generate(model, tok, [r["prompt"] for r in part], max_new_tokens, batch_size, desc="  generate")
            for r, reply in zip(part, replies):
                f.write(json.dumps(reply_record(r, reply)) + "\n")
                unfinished += not reply.ended
            f.flush()
    return unfinished


# ----------------------------------------------------------------------------------- exit examples


def fence_open(text: str) -> bool:
    return text.count(FENCE) % 2 == 1


def turn_close(prefix: str) -> str:
    """What closes a turn cut after `prefix` before <|im_end|>: a closing fence if one is open."""
    if not fence_open(prefix):
        return ""
    return ("" if prefix.endswith("\n") else "\n") + FENCE


def exit_example(tok: Any, messages: list[dict], tools: list[dict] | None, prefix: str) -> Example | None:
    """The conversation with assistant turn `prefix` + its close; loss only on the close and <|im_end|>
    (the tokens after the longest common prefix with the unclosed turn's body). None when that is not
    1..4 tokens."""
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    ids, mask = encode_conversation(tok, messages + [{"role": "assistant", "content": prefix + turn_close(prefix)}], tools)
    ids_open, _ = encode_conversation(tok, messages + [{"role": "assistant", "content": prefix}], tools)
    if ids_open[-2] != eos or ids[-2] != eos:
        raise ValueError(f"a rendered turn does not end with {EOS_TOKEN}: {ids_open[-3:]}, {ids[-3:]}")
    body = ids_open[:-2]
    common = 0
    while common < len(body) and common < len(ids) and body[common] == ids[common]:
        common += 1
    mask = [m if i >= common else 0 for i, m in enumerate(mask)]
    return (ids, mask) if 1 <= sum(mask) <= 4 else None


def has_alnum(text: str) -> bool:
    return any(ch.isalnum() for ch in text)


def token_loop_cut(tok: Any, ids: list[int]) -> tuple[int, int] | None:
    """Earliest end t of r >= 3 consecutive repeats of a period-p unit (p <= 16, p*r >= 6) whose text has a
    letter or digit: (t, p), or None."""
    for t in range(6, len(ids) + 1):
        for p in range(1, 17):
            r = max(3, -(-6 // p))
            if t - p * r < 0:
                break
            unit = ids[t - p: t]
            if all(ids[t - p * (k + 1): t - p * k] == unit for k in range(r)) and has_alnum(tok.decode(unit)):
                return t, p
    return None


def line_ends(lines: list[str]) -> list[int]:
    """Char offsets just after the newline of each complete line (all but the last piece of a split)."""
    ends, pos = [], 0
    for ln in lines[:-1]:
        pos += len(ln) + 1
        ends.append(pos)
    return ends


def first_repeated_line(lines: list[str]) -> int | None:
    """Index of the first complete line (>= 6 chars stripped, not a bare fence) seen before, or None."""
    seen: set[str] = set()
    for i, ln in enumerate(lines[:-1]):
        key = ln.strip()
        if len(key) >= 6 and key != FENCE and key in seen:
            return i
        seen.add(key)
    return None


def line_cuts(text: str, kind: str) -> list[int]:
    """Char offsets after the first repeated line and up to 2 lines after it; for a fenced "continue"
    reply of >= 6 lines without an earlier repeat also after its 4th code line."""
    lines = text.split("\n")
    ends = line_ends(lines)
    dup = first_repeated_line(lines)
    cuts = [] if dup is None else ends[dup: dup + 3]
    if kind == "continue" and lines[0].startswith(FENCE) and len(ends) >= 6 and (dup is None or dup > 4):
        cuts.append(ends[4])  # after "```cpp" + 4 lines
    return cuts


def reply_cuts(tok: Any, text: str, kind: str) -> list[int]:
    """All cut offsets of an unfinished reply: its line cuts, plus the token-loop cut and one or two
    periods later when that loop ends before the first line cut."""
    cuts = set(line_cuts(text, kind))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    loop = token_loop_cut(tok, ids)
    if loop is not None:
        t, p = loop
        if not cuts or len(tok.decode(ids[:t])) < min(cuts):
            cuts.update(len(tok.decode(ids[: t + k * p])) for k in range(3) if t + k * p <= len(ids))
    return sorted(cuts)


def onpolicy_examples(tok: Any, rows: list[dict]) -> list[Example]:
    """Exit examples from the unfinished replies of `generate` (prefixes holding a tool call skipped)."""
    out: list[Example] = []
    for r in tqdm(rows, desc="on-policy exits", unit="reply"):
        if r["ended"]:
            continue
        for cut in reply_cuts(tok, r["reply"], r["kind"]):
            prefix = r["reply"][:cut]
            if TOOL_CALL_OPEN in prefix:
                continue
            ex = exit_example(tok, r["messages"], r["tools"], prefix)
            if ex:
                out.append(ex)
    return out


def repeated_line_prefix(answer: str, rng: random.Random) -> str | None:
    """The answer up to a random nontrivial line, then that line once or twice more."""
    lines = answer.split("\n")
    cand = [i for i, ln in enumerate(lines) if len(ln.strip()) >= 6 and ln.strip() != FENCE and not ln.startswith(FENCE)]
    if not cand:
        return None
    i = rng.choice(cand)
    reps = rng.choice([1, 1, 2])
    return "\n".join(lines[: i + 1]) + "\n" + (lines[i] + "\n") * reps


def repeated_span_prefix(tok: Any, answer: str, rng: random.Random) -> str | None:
    """The answer up to a random token t, then its last p <= 6 tokens repeated (>= 2 times, ~6 tokens)."""
    ids = tok(answer, add_special_tokens=False)["input_ids"]
    if len(ids) < 8:
        return None
    t = rng.randint(4, len(ids) - 1)
    p = rng.randint(1, min(6, t))
    unit = ids[t - p: t]
    if not has_alnum(tok.decode(unit)):
        return None
    repeats = max(2, -(-6 // p) - 1) + rng.choice([0, 1])
    return tok.decode(ids[:t] + unit * repeats)


def synthetic_examples(tok: Any, rows: list[dict], rng: random.Random) -> list[Example]:
    """Exit examples from reference answers with a repeated line (half) or token span (half) spliced in."""
    out: list[Example] = []
    for r in tqdm(rows, desc="synthetic exits", unit="conv"):
        prompt = first_user_turn(r["messages"])
        answer = r["messages"][len(prompt)].get("content")
        if not answer or r["kind"] not in ("continue", "notool", "explain"):
            continue
        if rng.random() < 0.5:
            prefix = repeated_line_prefix(answer, rng)
        else:
            prefix = repeated_span_prefix(tok, answer, rng)
        if prefix is None or (FENCE in prefix[len(FENCE):] and not fence_open(prefix)):
            continue  # nothing to repeat, or the cut fell after the closing fence
        ex = exit_example(tok, prompt, r.get("tools"), prefix)
        if ex:
            out.append(ex)
    return out


# ------------------------------------------------------------------------------------------- build


def split_conversations(streams: TokenStreams) -> list[tuple[np.ndarray, np.ndarray]]:
    bounds = [*streams.chat_starts.tolist(), len(streams.chat)]
    return [(np.asarray(streams.chat[a:b]), np.asarray(streams.chat_mask[a:b])) for a, b in zip(bounds[:-1], bounds[1:])]


def interleave(convs: list[tuple[np.ndarray, np.ndarray]], exits: list[Example], eot: int,
               rng: random.Random) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(chat, chat_mask, chat_starts, conversations) of `convs` and `exits` (each + <|endoftext|>) shuffled."""
    extra = [(np.asarray(ids + [eot], np.uint16), np.asarray(mask + [0], np.uint8)) for ids, mask in exits]
    order = convs + extra
    rng.shuffle(order)
    starts = np.cumsum([0] + [len(c) for c, _ in order[:-1]]).astype(np.int64)
    return np.concatenate([c for c, _ in order]), np.concatenate([m for _, m in order]), starts, len(order)


def build(tok: Any, replies: list[dict], chat_rows: list[dict], packed: Path, out: Path, domain: str,
          n_synthetic: int, onpolicy_repeats: int, seed: int) -> dict:
    """Write <out>/<domain>/{train,validation} and <out>/manifest.json; returns the train summary.

    Synthetic examples come from the last 2*n_synthetic rows of a seeded shuffle of `chat_rows` (the first
    n_synthetic that yield an example); the same generator then shuffles the conversations."""
    rng = random.Random(seed)
    on = onpolicy_examples(tok, replies)
    chat_rows = list(chat_rows)
    rng.shuffle(chat_rows)
    syn = synthetic_examples(tok, chat_rows[-n_synthetic * 2:], rng)[:n_synthetic]
    log.info("loop-exit examples: %d on-policy (x%d), %d synthetic", len(on), onpolicy_repeats, len(syn))
    base = TokenStreams.load(packed / domain / "train")
    exits = on * onpolicy_repeats + syn
    chat, mask, starts, conversations = interleave(split_conversations(base), exits, tok.convert_tokens_to_ids(EOT_TOKEN), rng)
    text = np.asarray(base.text)
    dst = out / domain / "train"
    dst.mkdir(parents=True, exist_ok=True)
    for name, arr in (("text", text), ("chat", chat), ("chat_mask", mask), ("chat_starts", starts)):
        np.save(dst / f"{name}.npy", arr)
    shutil.copytree(packed / domain / "validation", out / domain / "validation", dirs_exist_ok=True)
    manifest = json.loads((packed / "manifest.json").read_text())
    train = {"text_tokens": int(len(text)), "chat_tokens": int(len(chat)), "conversations": conversations,
             "sha256": hashlib.sha256(text.tobytes() + chat.tobytes() + mask.tobytes()).hexdigest(),
             "loop_exit_conversations": len(exits), "loop_exit_onpolicy": len(on), "loop_exit_synthetic": len(syn)}
    manifest["domains"] = {domain: {"train": train, "validation": manifest["domains"][domain]["validation"]}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return train


# --------------------------------------------------------------------------------------------- cli


def _count(minimum: int):  # noqa: ANN202 - an argparse type
    def parse(value: str) -> int:
        n = int(value)
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return n
    return parse


def _existing(parser: argparse.ArgumentParser, *paths: Path) -> None:
    for path in paths:
        if not path.exists():
            parser.error(f"{path} does not exist")


def _cmd_generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    _existing(parser, args.model / "config.json", args.chat)
    if args.chunk % args.batch_size:
        parser.error("--chunk must be a multiple of --batch-size")
    import torch

    torch.set_num_threads(args.threads)
    rows = select_prompts(read_jsonl(args.chat), args.n_continue, args.n_other, args.seed)
    unfinished = generate_replies(args.model, rows, args.out, args.max_new_tokens, args.batch_size, args.chunk)
    print(json.dumps({"replies": len(rows), "unfinished": unfinished, "out": str(args.out)}))
    return 0


def _cmd_build(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    _existing(parser, args.replies, args.chat, args.tokenizer / "tokenizer.json",
              args.packed / "manifest.json", args.packed / args.domain / "train", args.packed / args.domain / "validation")
    if args.out.resolve() == args.packed.resolve():
        parser.error("--out must differ from --packed")
    train = build(load_tokenizer(args.tokenizer), read_jsonl(args.replies), read_jsonl(args.chat), args.packed, args.out,
                  args.domain, args.synthetic, args.onpolicy_repeats, args.seed)
    print(json.dumps(train))
    return 0


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m specialists.train loop-exit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    gen = steps.add_parser("generate", help="greedy replies of a model to fresh training prompts")
    gen.set_defaults(run=_cmd_generate, parser=gen)
    gen.add_argument("--model", type=Path, required=True, help="model dir (the model whose loops to exit)")
    gen.add_argument("--chat", type=Path, required=True, help="conversations jsonl the prompts come from")
    gen.add_argument("--out", type=Path, required=True, help="replies jsonl")
    gen.add_argument("--continue", dest="n_continue", type=_count(0), default=1400, help='"continue" prompts')
    gen.add_argument("--other", dest="n_other", type=_count(0), default=800, help='"explain" and "notool" prompts')
    gen.add_argument("--seed", type=int, default=0, help="shuffle of the conversations")
    gen.add_argument("--max-new-tokens", type=_count(1), default=256)
    gen.add_argument("--batch-size", type=_count(1), default=16)
    gen.add_argument("--chunk", type=_count(1), default=64, help="rows generated and written at a time")
    gen.add_argument("--threads", type=_count(1), default=1, help="torch intra-op threads")
    bld = steps.add_parser("build", help="the packed stream with loop-exit conversations added")
    bld.set_defaults(run=_cmd_build, parser=bld)
    bld.add_argument("--replies", type=Path, required=True, help="jsonl written by `generate`")
    bld.add_argument("--chat", type=Path, required=True, help="conversations jsonl of the synthetic exits")
    bld.add_argument("--tokenizer", type=Path, required=True, help="dir with tokenizer.json")
    bld.add_argument("--packed", type=Path, required=True, help="packed dir whose chat stream to extend")
    bld.add_argument("--out", type=Path, required=True, help="new packed dir")
    bld.add_argument("--domain", default="cpp")
    bld.add_argument("--synthetic", type=_count(0), default=2000, help="synthetic exit conversations (at most)")
    bld.add_argument("--onpolicy-repeats", type=_count(0), default=2, help="copies of each on-policy exit")
    bld.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    return args.run(args.parser, args)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(cli(sys.argv[1:]))
