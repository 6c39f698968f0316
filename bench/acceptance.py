"""Drafter acceptance against the backbone's own greedy decoding.

  python -m bench.acceptance --model DIR --prompts FILE.jsonl [--k 3] [--max-new-tokens 64] [--limit N]

Rows are {"prompt": raw text (completion style), "reference": optional continuation}. The backbone
decodes each prompt greedily; at every generated position the drafter chains K steps from the
backbone's hidden state. a_j is the fraction of positions at which the first j drafts all equal the
backbone's greedy tokens; mean_accepted is their sum. next_token_acc is the backbone's teacher-forced
top-1 accuracy on the references. The last line of output is one JSON object.

All chains are computed in one teacher-forced drafter pass over the greedy sequence (see
specialists/models/mtp.py): when the first j-1 drafts equal the greedy tokens, that pass feeds the
drafter exactly what chained drafting would, so a_j is exact.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.common import checkpoint_id, device_name, git_commit, prompt_text, read_jsonl, record
from specialists.models.mtp import MissingDrafterError, MTPDrafter, load_drafter

log = logging.getLogger("bench.acceptance")


@torch.no_grad()
def chain_hits(model, drafter: MTPDrafter, ids: torch.Tensor, first: int, last: int, k: int) -> torch.Tensor:
    """ids: [L] prompt + greedy tokens. Returns [N, k] bool: hit[s, j] = depth-j draft of the chain
    whose bonus token is ids[first+s] equals the greedy token, for bonus positions first..last."""
    hidden = model.model(input_ids=ids[None], use_cache=False).last_hidden_state  # [1, L, d]
    outs = drafter.forward_chains(hidden, ids[None], model.get_input_embeddings().weight, k)
    head = model.get_output_embeddings().weight
    rows = []
    for j, out in enumerate(outs):  # depth j+1 of the chain started at index s sits at s+j
        preds = drafter.logits(out[0], head).argmax(-1)  # [L-1]: index t predicts ids[t+2]
        starts = torch.arange(first - 1, last)  # chain start index s consumes (h_s, ids[s+1])
        rows.append(preds[starts + j] == ids[starts + j + 2])
    return torch.stack(rows, dim=1)


@torch.no_grad()
def next_token_accuracy(model, tokenizer, prompt: str, reference: str, device: str) -> tuple[int, int]:
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r = tokenizer(reference, add_special_tokens=False)["input_ids"]
    if not r:
        return 0, 0
    ids = torch.tensor(p + r, device=device)[None]
    logits = model(input_ids=ids, use_cache=False).logits[0]
    preds = logits[len(p) - 1 : -1].argmax(-1)
    return int((preds == ids[0, len(p) :]).sum()), len(r)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.acceptance", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--results", type=Path, default=None, help="append the result as a JSONL row here")
    parser.add_argument("--chat", action="store_true",
                        help="render each row's prompt (a user message) or messages through the checkpoint's chat "
                             "template with the generation prompt (what the server feeds a chat model)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if not (args.model / "model.safetensors").is_file():
        print(f"error: {args.model} has no model.safetensors", file=sys.stderr)
        return 2
    try:
        drafter = load_drafter(args.model, args.device)
    except MissingDrafterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ident = checkpoint_id(args.model)
    print(f"loaded checkpoint: {json.dumps(ident)}; drafter trained for depth {drafter.cfg.num_speculative_tokens}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32).to(args.device).eval()
    stop = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    rows = read_jsonl(args.prompts, args.limit)
    hits: list[torch.Tensor] = []
    correct = total = 0
    started = time.perf_counter()
    for row in tqdm(rows, desc="acceptance", unit="prompt", file=sys.stderr):
        text = prompt_text(row, tokenizer, args.chat)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"][-(model.config.max_position_embeddings // 2) :]
        ids = torch.tensor(prompt_ids, device=args.device)
        out = model.generate(ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=args.max_new_tokens + args.k,
                             do_sample=False, eos_token_id=stop, pad_token_id=stop[0])[0]
        first, last = len(prompt_ids), min(len(out) - 1 - args.k, len(prompt_ids) + args.max_new_tokens - 1)
        if last >= first:
            hits.append(chain_hits(model, drafter, out, first, last, args.k).cpu())
        if row.get("reference"):
            c, n = next_token_accuracy(model, tokenizer, text, row["reference"], args.device)
            correct, total = correct + c, total + n
    all_hits = torch.cat(hits) if hits else torch.zeros(0, args.k, dtype=torch.bool)
    prefix_ok = all_hits.long().cumprod(dim=1).float()
    by_depth = [round(float(x), 4) for x in prefix_ok.mean(0)] if len(all_hits) else [0.0] * args.k
    result = {
        "model": str(args.model),
        "prompts": len(rows),
        "next_token_acc": round(correct / total, 4) if total else None,
        "acceptance_by_depth": by_depth,
        "mean_accepted": round(sum(by_depth), 4),
    }
    log.info("%d positions in %.1f s on %s", len(all_hits), time.perf_counter() - started, device_name(args.device))
    record(args.results, {"bench": "acceptance", **result, "k": args.k, "positions": len(all_hits), "max_new_tokens": args.max_new_tokens, "chat": args.chat,
                          "checkpoint": ident, "device": device_name(args.device), "commit": git_commit()})
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
