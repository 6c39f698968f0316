"""Chat-like load on one engine, in process: requests arrive at a Poisson rate, each a shared head (a
system prompt and tool list, cached by the warm-up as a server that has seen it) and a question of its own, and the engine
steps as a server's loop would. Reports time to first token and per output token (p50 / p99), output
tokens per second, and what the engine did (prefix hits, prefills run as CUDA graphs, steps decoded ahead).

    python -m bench.engine_load --shape llama-1b --device cuda --dtype bfloat16 --rate 40 --requests 128
    python -m bench.engine_load --model deploy/models/shell --rate 4 --requests 16

--compare-prefill-graphs runs the same arrivals twice more with `prefill_graph_tokens` 0 (every prefill
eager), alternated with the default: rows `variant` "graphs" and "eager". Greedy, EOS ignored, speculation
off (the policy's gate is measured by bench.decode --policy auto). Random token ids: the figures are of
shapes and scheduling, not of text. The arrivals and prompts are the same in every run (--seed).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import DTYPES, device_name, git_commit, record
from bench.decode_shape import shape_names
from bench.shapes import build_checkpoint
from specialists.engine import Engine
from specialists.sampling import SamplingParams


def _arrivals(args: argparse.Namespace, vocab: int, warm: bool = False) -> tuple[list[float], list[list[int]]]:
    """(arrival offsets in s, prompts): Poisson arrivals; the head (one per seed) then a question of 40-120
    tokens (warm: other questions, for the warm-up)."""
    top = min(vocab, 4000)
    rng = random.Random(args.seed)
    head = [rng.randrange(10, top) for _ in range(args.head_tokens)]
    rng = random.Random(f"{args.seed} warm" if warm else args.seed + 1)
    t, times, prompts = 0.0, [], []
    for _ in range(args.requests):
        times.append(t)
        t += rng.expovariate(args.rate)
        prompts.append(head + [rng.randrange(10, top) for _ in range(rng.randint(40, 120))])
    return times, prompts


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def run_load(engine: Engine, times: list[float], prompts: list[list[int]], max_new: int) -> dict:
    """Feeds the arrivals to the engine in real time, stepping it as a serving loop would -> figures."""
    params = SamplingParams(max_tokens=max_new, ignore_eos=True)
    stats0 = dict(engine.stats)
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    arrived: dict[str, float] = {}
    t0, i = time.perf_counter(), 0
    while i < len(times) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while i < len(times) and times[i] <= now:
            arrived[engine.add_request(prompts[i], params)] = t0 + times[i]
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, times[i] - (time.perf_counter() - t0)))
            continue
        outs = engine.step()
        stamp = time.perf_counter()
        for o in outs:
            first.setdefault(o.request_id, stamp)
            if o.finished:
                done[o.request_id] = (stamp, len(o.token_ids))
    wall = time.perf_counter() - t0
    ttft = [1e3 * (first[r] - a) for r, a in arrived.items()]
    tpot = [1e3 * (done[r][0] - first[r]) / (done[r][1] - 1) for r in arrived if done[r][1] > 1]
    grew = {k: engine.stats.get(k, 0) - stats0.get(k, 0) for k in ("prefix_hit_tokens", "padded_prefills", "padded_hit_prefills")}
    return {"requests": len(arrived), "finished": len(done), "wall_s": round(wall, 3),
            "output_tok_s": round(sum(n for _, n in done.values()) / wall, 1),
            "ttft_ms_p50": _pct(ttft, 0.5), "ttft_ms_p99": _pct(ttft, 0.99),
            "tpot_ms_p50": _pct(tpot, 0.5), "tpot_ms_p99": _pct(tpot, 0.99), **grew}


def _engine(path: Path, args: argparse.Namespace, graph_tokens: int | None) -> Engine:
    eng = Engine.from_pretrained(str(path), device=args.device, dtype=DTYPES[args.dtype], max_num_seqs=args.max_num_seqs,
                                 prefill_graph_tokens=graph_tokens, policy=None, load_mtp=False)
    eng.capture_graphs()
    warm_times, warm_prompts = _arrivals(argparse.Namespace(**{**vars(args), "requests": min(8, args.requests)}),
                                         eng.model.lm_head.shape[0], warm=True)
    run_load(eng, [0.0] * len(warm_times), warm_prompts, 4)  # compiles, caches the head (a server's system prompt), meets the shapes
    return eng


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="a checkpoint directory")
    src.add_argument("--shape", choices=shape_names(), help="random weights of this shape, built on the device")
    ap.add_argument("--shape-dir", type=Path, default=None, help="where --shape's checkpoint is built (default: a temp dir)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=8.0, help="arrivals per second (Poisson)")
    ap.add_argument("--head-tokens", type=int, default=512, help="the shared head every prompt starts with")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare-prefill-graphs", action="store_true", help="also run with every prefill eager, alternated")
    ap.add_argument("--results", type=Path, default=None, help="append each row here (JSONL)")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.rate <= 0:
        ap.error("--requests must be >= 1 and --rate > 0")
    if args.compare_prefill_graphs and (not args.device.startswith("cuda") or args.dtype == "float32"):
        ap.error("--compare-prefill-graphs: prefill graphs run on a CUDA device in bfloat16 / float16 only")
    tmp = None
    path = args.model
    if args.shape:
        if args.shape_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix=f"cantata_{args.shape}_")
            args.shape_dir = Path(tmp.name)
        path = build_checkpoint(args.shape, args.shape_dir, DTYPES[args.dtype], args.device)
    variants = [("graphs", None), ("eager", 0), ("graphs", None), ("eager", 0)] if args.compare_prefill_graphs else [("default", None)]
    for name, tokens in variants:
        eng = _engine(path, args, tokens)
        times, prompts = _arrivals(args, eng.model.lm_head.shape[0])
        row = {"bench": "engine_load", "shape": args.shape, "model": None if args.shape else str(args.model), "variant": name,
               "prefill_graph_tokens": eng.cfg.prefill_graph_tokens, "device": args.device, "dtype": args.dtype,
               "rate": args.rate, "head_tokens": args.head_tokens, "max_new_tokens": args.max_new_tokens,
               "max_num_seqs": args.max_num_seqs, "seed": args.seed, **run_load(eng, times, prompts, args.max_new_tokens),
               "device_name": device_name(args.device), "commit": git_commit()}
        print(json.dumps(row), flush=True)
        record(args.results, row)
        del eng
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
