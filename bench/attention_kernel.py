"""The static decode attention kernel (specialists/ops/attention_cuda.py) alone, per real model's heads,
timed as a CUDA graph of 30 calls (what a decode step replays; bench.common.graph_us), bf16:

  python -m bench.attention_kernel [--shapes smollm2-135m llama-1b] [--results FILE] [--device cuda|cpu]

Cases: one query token at contexts 384, 1000 and 2000 (static widths 512, 1024, 2048), batch 8 and 32
at 384, and one row verifying 4 tokens at 384. Each row: us per call and equal_wider, whether the
same inputs at twice the static width give the same bits (chunks past a query's keys must add
nothing: a verify then computes what a plain decode of the token does). --device cpu runs the kernel
in Triton's interpreter (TRITON_INTERPRET=1; a check, not a timing) on smaller cases.
"""

from __future__ import annotations

import argparse
import json
import os
import types

import torch

from bench.common import device_name, git_commit, graph_us
from bench.shapes import shape_config

BLOCK = 16
CALLS = 30  # calls a graph: a decode step's attention layers, back to back
CASES = [(1, 1, 384, 512), (1, 1, 1000, 1024), (1, 1, 2000, 2048), (8, 1, 384, 512), (32, 1, 384, 512), (4, 4, 384, 512)]
CPU_CASES = [(1, 1, 200, 256), (4, 4, 300, 512), (2, 1, 70, 512)]


def _inputs(heads: int, kv_heads: int, hd: int, tokens: int, per_row: int, ctx: int, width: int, dev: str):
    g = torch.Generator().manual_seed(0)
    rows = tokens // per_row
    blocks = rows * width // BLOCK + 4
    k = torch.randn(blocks, BLOCK, kv_heads, hd, generator=g).to(dev, torch.bfloat16)
    v = torch.randn(blocks, BLOCK, kv_heads, hd, generator=g).to(dev, torch.bfloat16)
    tables = torch.randperm(blocks - 4, generator=g)[: rows * width // BLOCK].view(rows, width // BLOCK)
    q = torch.randn(tokens, heads, hd, generator=g).to(dev, torch.bfloat16)
    pos = torch.tensor([ctx - per_row + i for _ in range(rows) for i in range(per_row)], dtype=torch.int64)
    batch = types.SimpleNamespace(block_tables=tables.to(dev), positions=pos.to(dev), max_query_len=per_row,
                                  max_context_len=width)
    return q, k, v, batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama-1b"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--results", default=None)
    args = parser.parse_args(argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("on CPU the kernel runs in Triton's interpreter: set TRITON_INTERPRET=1")
    from specialists.ops.attention_cuda import paged_attention_static

    out = []
    for name in args.shapes:
        cfg = shape_config(name)
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        for tokens, per_row, ctx, width in CPU_CASES if args.device == "cpu" else CASES:
            q, k, v, batch = _inputs(heads, kv_heads, hd, tokens, per_row, ctx, width, args.device)
            o = paged_attention_static(q, k, v, batch)
            wide = types.SimpleNamespace(**{**vars(batch), "max_context_len": 2 * width,
                                            "block_tables": torch.nn.functional.pad(batch.block_tables, (0, width // BLOCK))})
            row = {"bench": "attention_kernel", "shape": name, "heads": heads, "kv_heads": kv_heads, "head_dim": hd,
                   "tokens": tokens, "tokens_per_row": per_row, "context": ctx, "width": width,
                   "us": None if args.device == "cpu" else round(graph_us([lambda: paged_attention_static(q, k, v, batch)] * CALLS), 2),
                   "equal_wider": bool(torch.equal(o, paged_attention_static(q, k, v, wide))),
                   "device_name": device_name(args.device), "commit": git_commit()}
            print(json.dumps(row), flush=True)
            out.append(row)
    if args.results:
        with open(args.results, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in out)
    return 0 if all(r["equal_wider"] for r in out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
