"""Decoding ahead (spec/decode_ahead.py) on and off, interleaved in one engine: the same weights, the
same prompts, rounds alternating which side goes first, so that the machine's drift hits both.

  python -m bench.decode_ahead_ab --shape llama-1b --batch-size 1 --prompts 4 --rounds 4 [--results F]

Prints one JSON line: ms per token one sequence waited (each side's rounds and median), off / on,
aggregate tok/s with it on, whether the two sides' tokens are identical (the last round of each: both
read the prompts from the prefix cache), the step-ahead counts, the device and the commit. Random
weights of --shape built on the device (bench/shapes.py), bf16, greedy, 128 new tokens, prompts of
the shell specialist's set cut to their last 256 tokens. Needs CUDA graphs (a GPU).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.common import git_commit
from bench.decode_shape import shape_names
from bench.shapes import build_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=shape_names(), required=True)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--results", type=Path, default=None, help="append the line here too")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.decode_ahead_ab needs a CUDA device (decoding ahead runs with CUDA graphs)")
    from policies.policy import SpeculationPolicy
    from specialists.engine import Engine
    from specialists.sampling import SamplingParams

    model = build_checkpoint(args.shape, Path(tempfile.mkdtemp(prefix=f"cantata-{args.shape}-")), torch.bfloat16, "cuda")
    eng = Engine.from_pretrained(str(model), device="cuda", dtype=torch.bfloat16, max_num_seqs=args.batch_size,
                                 policy=SpeculationPolicy(mode="off"))
    eng.warmup()
    rows = [json.loads(line) for line in (ROOT / "bench" / "data" / "shell" / "prompts.jsonl").read_text().splitlines()]
    prompts = [eng.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"][-256:] for r in rows[:args.prompts]]
    params = SamplingParams(max_tokens=args.max_new_tokens, ignore_eos=True)
    allowed = eng.speculator.decoding.allowed
    if allowed is None:
        raise SystemExit("this engine does not decode ahead (no CUDA graphs)")
    times: dict[str, list[float]] = {"on": [], "off": []}
    outs: dict[str, list] = {}
    waited = args.max_new_tokens * -(-len(prompts) // args.batch_size)
    for r in range(args.rounds):
        for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
            eng.speculator.decoding.allowed = allowed if side == "on" else None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            toks = [o.token_ids for i in range(0, len(prompts), args.batch_size)
                    for o in eng.generate(prompts[i:i + args.batch_size], params)]
            torch.cuda.synchronize()
            times[side].append(1e3 * (time.perf_counter() - t0) / waited)
            outs[side] = toks
    med = {s: sorted(v)[len(v) // 2] for s, v in times.items()}
    line = {"bench": "decode_ahead_ab", "shape": args.shape, "batch_size": args.batch_size, "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "dtype": "bfloat16",
            "ms_per_token_on": [round(x, 4) for x in times["on"]], "ms_per_token_off": [round(x, 4) for x in times["off"]],
            "median_on": round(med["on"], 4), "median_off": round(med["off"], 4), "off_over_on": round(med["off"] / med["on"], 4),
            "agg_tok_s_on": round(args.batch_size * 1e3 / med["on"], 1), "identical": outs["on"] == outs["off"],
            "stats": eng.stats["decode_ahead"], "device": torch.cuda.get_device_name(), "commit": git_commit()}
    print(json.dumps(line))
    if args.results is not None:
        with args.results.open("a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
