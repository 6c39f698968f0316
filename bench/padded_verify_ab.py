"""Padded verify rows on and off in one engine, with plain decoding beside them: a row that cannot
speculate (inside a tool call, near a limit) among speculating rows verifies the step's K drafts and
keeps none (specialists/scheduler.plan_drafts: pad_k), so the step stays static (a CUDA graph); off,
such steps run eagerly as mixed steps. Rounds alternate the sides' order.

  python -m bench.padded_verify_ab --shape llama-1b --batch-size 8 --spec-k 3          # a GPU
  python -m bench.padded_verify_ab --model deploy/models/build --batch-size 8 --spec-k 5 --tool-tag

`--tool-tag`: a token the first request emits mid-run becomes the tool-call open tag, so that request
enters a tool call there (random-weight shapes open calls by themselves). Off: pad_k zeroed after the
scheduler plans the step (this bench's switch; the engine has none). Prints one JSON line per run:
seconds, steps, static steps and the median / p90 engine step per side and round, whether the padded
side's tokens equal the unpadded and the plain ones per round (the prefix cache is off: every side
prefills cold), the device and the commit. Greedy, EOS ignored; on a CPU the static steps run eagerly.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.common import DTYPES, git_commit, read_jsonl
from bench.decode_shape import shape_names
from bench.shapes import build_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--shape", choices=shape_names(), help="random weights of this shape, built on the device")
    src.add_argument("--model", type=Path, help="a checkpoint directory with its drafter")
    ap.add_argument("--prompts", type=Path, default=ROOT / "bench" / "data" / "shell" / "prompts.jsonl")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--spec-k", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tool-tag", action="store_true", help="make a token the first request emits mid-run its tool-call tag")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on CUDA, float32 elsewhere")
    ap.add_argument("--results", type=Path, default=None, help="append the line here too")
    return ap.parse_args(argv)


def _run(eng, prompts: list[list[int]], params) -> tuple[list, dict]:
    steps, static, times = eng.steps, eng.runner.static_steps, []
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(p, params, f"r{i}")
    got: dict[str, list[int]] = {}
    while eng.has_unfinished():
        t = time.perf_counter()
        got.update({o.request_id: list(o.token_ids) for o in eng.step() if o.finished})
        times.append(1e3 * (time.perf_counter() - t))
    sync()
    times.sort()
    return [got[f"r{i}"] for i in range(len(prompts))], {
        "s": round(time.perf_counter() - t0, 4), "steps": eng.steps - steps, "static_steps": eng.runner.static_steps - static,
        "median_step_ms": round(times[len(times) // 2], 3), "p90_step_ms": round(times[int(0.9 * len(times))], 3)}


def main(argv: list[str] | None = None) -> dict:
    args = _args(argv)
    from policies.policy import SpeculationPolicy
    from specialists.engine import Engine
    from specialists.sampling import SamplingParams

    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    model = args.model or build_checkpoint(args.shape, Path(tempfile.mkdtemp(prefix=f"cantata-{args.shape}-")), dtype,
                                           args.device, drafter_k=args.spec_k)
    flags = {} if args.device.startswith("cuda") else {"static_batches": True, "pad_batches": True}
    on = SpeculationPolicy(mode="on", num_speculative_tokens=args.spec_k)
    eng = Engine.from_pretrained(str(model), device=args.device, dtype=dtype, max_num_seqs=args.batch_size, policy=on,
                                 enable_prefix_cache=False, **flags)
    eng.capture_graphs()
    prompts = [eng.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"][-200:]
               for r in read_jsonl(args.prompts, args.batch_size)]
    params = SamplingParams(max_tokens=args.max_new_tokens, ignore_eos=True)
    if args.tool_tag:
        first = eng.generate(prompts[:1], params)[0].token_ids
        new = [t for i, t in enumerate(first) if i >= 8 and t not in first[:i] + sum(prompts, [])]
        if not new:
            raise SystemExit("--tool-tag: the first request emits no new token mid-run to open a call with")
        eng.triggers = replace(eng.triggers, tool_open_id=new[0])
    plan = eng.scheduler.plan_drafts

    def unpadded(*a) -> None:  # the step as before padded rows: mixed rows run eagerly
        plan(*a)
        for s in eng.scheduler.running:
            s.pad_k = 0

    rounds: dict[str, list[dict]] = {"pad": [], "no_pad": [], "plain": []}
    same_no_pad, same_plain = [], []
    for r in range(args.rounds):
        outs = {}
        for side in ("pad", "no_pad", "plain") if r % 2 == 0 else ("plain", "no_pad", "pad"):
            eng.scheduler.plan_drafts = plan if side == "pad" else unpadded
            eng.set_policy(SpeculationPolicy(mode="off") if side == "plain" else on)
            outs[side], row = _run(eng, prompts, params)
            rounds[side].append(row)
        same_no_pad.append(outs["pad"] == outs["no_pad"])
        same_plain.append(outs["pad"] == outs["plain"])
    eng.scheduler.plan_drafts = plan
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    line = {"bench": "padded_verify_ab", "model": args.shape or str(args.model), "k": args.spec_k, "batch_size": args.batch_size,
            "tool_tag": args.tool_tag, "dtype": str(dtype).removeprefix("torch."), "rounds": rounds,
            "pad_over_no_pad_time": [round(a["s"] / b["s"], 4) for a, b in zip(rounds["pad"], rounds["no_pad"])],
            "identical_pad_no_pad": same_no_pad, "identical_pad_plain": same_plain, "device": dev, "commit": git_commit()}
    print(json.dumps(line))
    if args.results is not None:
        with args.results.open("a") as f:
            f.write(json.dumps(line) + "\n")
    return line


if __name__ == "__main__":
    main()
