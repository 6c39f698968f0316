"""Decode speed: our engine against transformers' generate on the same weights, prompts and device.

  python -m bench.decode --model DIR --prompts FILE.jsonl [--batch-size B] [--max-new-tokens N]
                         [--device cpu|cuda] [--limit N] [--dtype float32|bfloat16] [--results FILE]
                         [--spec-k K [--acceptance greedy|rejection|typical]] [--skip-hf] [--bound]
                         [--prompt-tokens N] [--prefix-ttft]
  python -m bench.decode --shape llama-1b|llama-3b|bamba-1b|smollm2-135m [--shape-dir DIR] [--profile FILE] ...

--shape NAME builds random weights of a named shape on the device (bench/shapes.py; no download, the
default specialists' tokenizer, prompts from bench/data/shell unless --prompts) and adds the figures
against the memory-bandwidth bound (bench/decode_shape.py: params, weight_bytes, bandwidth_tb_s,
bound_ms, ms_per_token, ratio_to_bound; with --spec-k also verify_over_decode, draft_over_target).
The bound is weight_bytes / the bandwidth measured in the same run; weight_bytes counts every parameter
once at its stored width, the input embedding only when it is tied to the lm_head (a decode step reads
one row of an untied embedding, all of the lm_head).

Rows are {"prompt": raw text (completion style)}; each prompt is tokenized without special tokens and
cut to its last 256 tokens. Both sides decode greedily with EOS ignored, so every prompt yields
exactly N new tokens, in batches of B prompts: the engine gets each batch at once (max_num_seqs = B),
transformers gets it left-padded (at B = 1 there is no padding, a fair single-sequence figure). Both
are warmed up before timing (the engines on every batch's reversed prompts, transformers on the
first's). tok/s is generated tokens over wall time, aggregated over the
batch; identical is the fraction of prompts whose greedy tokens equal transformers' exactly,
hf_prefix_agreement the fraction of our tokens that come before each prompt's first difference. The last
line of output is one JSON object.

With --spec-k K the same prompts also go through the engine with MTP speculation (K drafts per step,
policy mode "on"), timed in the same run: spec_tok_s, speedup (over the engine without speculation),
identical_spec (greedy tokens equal to the non-speculative run's), mean_accepted (drafts kept per
step) and acceptance_by_position (a_j: fraction of depth-j drafts kept when drafted).

With --spec-k two identical engines are loaded, both with the drafter, and swap sides every other
batch: two instances of one engine in one process can differ in speed by up to ~23% on a CPU (the
first one made was the faster, 2026-11-26), which a fixed plain / speculative pair counted as
speculation's gain or loss. An engine keeps its side of a batch in every --repeat round, so a later
round takes from the prefix cache what that side cached (bench/decode_sides.py `_role`). --repeat R times every batch R times; speedup_after_first_round leaves
out the first, where the auto gate is still judging. With --policy auto: `gates` (each engine's
speed-up and slow verdicts per bucket) and `step_times` (both engines' timed steps by what the gate
decided, "off" the plain side: steps, seconds, tokens, us per token; where auto's time went).
speedup_ci95: a 95% bootstrap interval of speedup over the timed (plain, speculative) pairs of
batches (timed_pairs of them): whether a speed-up differs from 1.0 by more than the run's noise.

prefix_hit_tokens (and spec_prefix_hit_tokens) count the prompt tokens the timed run took from the
prefix cache. With prompts that share a long head (bench/data/cpp/shared_prefix.jsonl: one system
prompt and tool list, different questions; use --prompt-tokens 512 so that the head is not cut off),
--prefix-ttft adds the time to first token of the first request against the later ones, and against
the same requests without the prefix cache (bench/prefix_ttft.py; the speculative engine's with --spec-k).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM

from bench import prefix_ttft
from bench.common import DTYPES, checkpoint_id, device_name, git_commit, prompt_text, read_jsonl, record
from bench.decode_shape import add_arguments, bound_figures, prepare_shape, shape_names
from bench.decode_sides import Sides, speedup_interval, timed, timed_engines, warm_up

log = logging.getLogger("bench.decode")

PROMPT_TOKENS = 256


def _batches(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


class UsageError(ValueError):
    """A refused run (bad arguments, missing weights or drafter, no prompts): main prints it, exits 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="a checkpoint directory")
    source.add_argument("--shape", choices=shape_names(), help="random weights of this shape, built on the device")
    parser.add_argument("--prompts", type=Path, default=None, help="JSONL of {prompt} (required with --model)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--results", type=Path, default=None, help="append the result as a JSONL row here")
    parser.add_argument("--spec-k", type=int, default=None, help="also run with K-token MTP speculation")
    parser.add_argument("--acceptance", choices=["greedy", "rejection", "typical"], default="greedy")
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help="draft over the first N tokens of the drafter's vocabulary file (0: all tokens)")
    parser.add_argument("--draft-min-confidence", type=float, default=None,
                        help="stop a draft chain below this drafter probability (default: the engine's, off)")
    parser.add_argument("--policy", choices=["on", "auto"], default="on",
                        help="the speculative engine's mode: on (always draft) or auto (the gate decides per step, "
                             "as a served specialist's default policy does)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="time every batch this many times, plain and speculative alternately (outputs from the "
                             "first; later rounds take the prompts from the prefix cache): less noise on short runs, "
                             "and the auto gate's judgement carried from round to round as in a running server "
                             "(speedup_after_first_round: once the gate has judged)")
    parser.add_argument("--k-choices", default=None, help="with --policy auto: other K values the gate may pick "
                        "per batch-size bucket, e.g. 1,5 (auto.k_choices)")
    parser.add_argument("--chat", action="store_true",
                        help="render each row's prompt (a user message) or messages through the checkpoint's chat "
                             "template with the generation prompt, kept whole (what the server feeds a chat model)")
    parser.add_argument("--decode-steps", type=int, default=None,
                        help="greedy decodes per static step of the plain engine (default: 4 with CUDA graphs, else 1)")
    parser.add_argument("--no-decode-ahead", action="store_true",
                        help="launch no plain step before the host has read the one before (spec/decode_ahead.py; "
                             "default: on with CUDA graphs)")
    parser.add_argument("--no-verify-ahead", action="store_true",
                        help="launch no verify before the host has read the one before (spec/verify_ahead.py; "
                             "default: on with CUDA graphs, attention-only models)")
    parser.add_argument("--prefill-graph-tokens", type=int, default=None,
                        help="a fresh prompt's prefill as a CUDA graph up to N tokens (specialists/prefill_graph.py; "
                             "default: 2048 with CUDA graphs in half precision; 0: every prefill eager)")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="keep each prompt's last N tokens")
    parser.add_argument("--prefix-ttft", action="store_true",
                        help="TTFT of the first request against later ones sharing its prefix (bench/prefix_ttft.py)")
    parser.add_argument("--quantization", choices=["none", "int8", "q4", "auto"], default="none",
                        help="the target's products on the CPU (specialists/quantize.py; the row records the resolved mode); "
                             "identical then compares with fp32 transformers")
    parser.add_argument("--skip-hf", action="store_true", help="do not run transformers (hf_tok_s, ratio, identical: null)")
    add_arguments(parser)
    return parser


def _check_model(args: argparse.Namespace) -> None:
    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise UsageError("--batch-size and --max-new-tokens must be >= 1")
    if args.prompts is None:
        raise UsageError("--model needs --prompts")
    if (args.model / "base.json").is_file():  # weights imported on first use (specialists/base_checkpoint.py)
        return
    for name in ("model.safetensors", "config.json"):
        if not (args.model / name).is_file():
            raise UsageError(f"{args.model} has no {name}")


def _load(args: argparse.Namespace) -> Sides:
    """The engine (speculation off), the speculative engine (with --spec-k) and transformers' model."""
    from policies.policy import SpeculationPolicy
    from specialists.engine import Engine  # after the refusal: no model work without weights
    from specialists.models.mtp import MissingDrafterError

    dtype = DTYPES[args.dtype]
    off, policy = SpeculationPolicy(mode="off"), None
    if args.spec_k is not None:
        if args.spec_k < 1:
            raise UsageError("--spec-k must be >= 1")
        policy = SpeculationPolicy(mode=args.policy, num_speculative_tokens=args.spec_k, acceptance=args.acceptance)
        if args.k_choices:
            policy = policy.merged({"auto": {"k_choices": [int(k) for k in args.k_choices.split(",")]}})

    def load(pol: Any) -> Any:
        return Engine.from_pretrained(str(args.model), device=args.device, dtype=dtype, max_num_seqs=args.batch_size,
                                      policy=pol, decode_steps=args.decode_steps, quantization=args.quantization,
                                      decode_ahead=False if args.no_decode_ahead else None, prefill_graph_tokens=args.prefill_graph_tokens,
                                      verify_ahead=False if args.no_verify_ahead else None,
                                      draft_vocab_size=args.draft_vocab, draft_min_confidence=args.draft_min_confidence)

    # with --spec-k two identical engines, each running both sides in turn (the module's docstring says why)
    try:
        engine, spec_engine = (load(off), None) if policy is None else (load(policy), load(policy))
    except MissingDrafterError as exc:  # lesson 1: never speculate with untrained drafter weights
        raise UsageError(str(exc)) from exc
    if spec_engine is not None:
        engine.set_policy(off)
        spec_engine.totals = engine.totals  # one count of the speculative runs, whichever engine ran them
    hf, pad_id = None, 0
    if not args.skip_hf:
        from specialists.base_checkpoint import resolve_weights

        hf = AutoModelForCausalLM.from_pretrained(str(resolve_weights(args.model)), dtype=dtype).to(args.device).eval()
        hf.generation_config.eos_token_id = None  # ignore EOS without masking it: the same greedy choice as ours
        pad_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    return Sides(engine, spec_engine, hf, pad_id, args.device, args.max_new_tokens, policy)


def _prompts(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    rows = read_jsonl(args.prompts, args.limit)
    cut = None if args.chat else -args.prompt_tokens  # a rendered chat is kept whole: its head is the template's
    try:
        texts = [prompt_text(r, tokenizer, args.chat) for r in rows]
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    prompts = [ids[cut:] if cut else ids for t in texts if (ids := tokenizer(t, add_special_tokens=False)["input_ids"])]
    if not prompts:
        raise UsageError(f"no non-empty prompts in {args.prompts}")
    return prompts


def _measure(sides: Sides, batches: list[list[list[int]]], args: argparse.Namespace,
             num_prompts: int) -> tuple[dict, float, float, int]:
    """The result line's figures; also the engine's and transformers' seconds and the prefix hits."""
    engines = [e for e in (sides.engine, sides.spec_engine) if e is not None]
    hits = lambda: sum(e.stats.get("prefix_hit_tokens", 0) for e in engines) // len(engines)  # noqa: E731 - a side's
    hits_before = hits()
    captures = lambda: sum(e.stats["graph_captures"] for e in engines)  # noqa: E731
    captures_before = captures()
    ours, spec, t_engine, t_spec = timed_engines(sides, batches, args.spec_k, args.repeat)
    captured_timed = captures() - captures_before  # graphs captured inside the timed run (their cost is in it)
    lens = iter(len(o) for o in ours)  # the longest output of each batch: the decode steps one sequence waited
    args.token_steps = sum(max(next(lens) for _ in batch) for batch in batches)
    prefix_hits = args.spec_prefix_hits = hits() - hits_before  # both engines ran both sides alike
    engine_tok_s = sum(len(o) for o in ours) / t_engine if t_engine > 0 else 0.0
    result = {"model": str(args.model), "device": args.device, "batch_size": args.batch_size,
              "quantization": sides.engine.cfg.quantization, "decode_ahead": sides.engine.stats["decode_ahead"],
              "verify_ahead": sides.spec_engine.stats["verify_ahead"] if sides.spec_engine is not None else None,
              "prefill_graph_tokens": sides.engine.cfg.prefill_graph_tokens, "padded_prefills": sides.engine.stats["padded_prefills"],
              "padded_hit_prefills": sides.engine.stats["padded_hit_prefills"], "graphs_captured_timed": captured_timed,
              "engine_tok_s": round(engine_tok_s, 2), "hf_tok_s": None, "ratio": None, "identical": None}
    t_hf = 0.0
    if not args.skip_hf:
        theirs, t_hf = timed(sides.run_hf, batches, args.device, "transformers")
        hf_tokens = sum(len(o) for o in theirs)
        same = sum(int(a == b) for a, b in zip(ours, theirs))
        hf_tok_s = hf_tokens / t_hf if t_hf > 0 else 0.0
        lead = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in zip(ours, theirs)]
        result.update(hf_tok_s=round(hf_tok_s, 2), ratio=round(engine_tok_s / hf_tok_s, 4) if hf_tok_s > 0 else None,
                      identical=round(same / num_prompts, 4),  # and the share of tokens before each first difference:
                      hf_prefix_agreement=round(sum(lead) / max(1, sum(len(a) for a in ours)), 4))
    if sides.spec_engine is not None:
        spec_tok_s = sum(len(o) for o in spec) / t_spec if t_spec > 0 else 0.0
        tot = sides.spec_engine.totals
        result.update(
            spec_k=args.spec_k, acceptance=args.acceptance, policy=args.policy, spec_tok_s=round(spec_tok_s, 2),
            speedup=round(spec_tok_s / engine_tok_s, 4) if engine_tok_s > 0 else None,
            identical_spec=round(sum(int(a == b) for a, b in zip(ours, spec)) / num_prompts, 4),
            mean_accepted=round(tot.mean_accepted, 4),
            acceptance_by_position=[round(x, 4) for x in tot.acceptance_by_position],
            spec_prefix_hit_tokens=args.spec_prefix_hits,
        )
        if args.policy == "auto":  # what each engine's gate measured (plain / speculative per bucket) and decided
            result["gates"] = [{k: sides.gate_of(e, True).snapshot()[k] for k in ("measured_speedup", "slow_buckets", "fallbacks")}
                               for e in (sides.engine, sides.spec_engine)]
            result["step_times"] = sides.engine.step_times.merged(sides.spec_engine.step_times).as_dict()
    result["prefix_hit_tokens"] = prefix_hits
    return result, t_engine, t_hf, prefix_hits


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        ident = prepare_shape(args, DTYPES[args.dtype]) if args.shape else None
        _check_model(args)
        ident = ident or checkpoint_id(args.model)
        print(f"loaded checkpoint: {json.dumps(ident)}", flush=True)
        sides = _load(args)
        prompts = _prompts(args, sides.engine.tokenizer)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    batches = _batches(prompts, args.batch_size)
    warm_up(sides, batches, args.skip_hf)
    result, t_engine, t_hf, prefix_hits = _measure(sides, batches, args, len(prompts))
    if args.shape or args.bound or args.profile is not None:
        result.update(bound_figures(sides, batches, args, t_engine, args.token_steps))
    if args.prefix_ttft:
        result.update(prefix_ttft.measure(prefix_ttft.loader(args, DTYPES[args.dtype]), prompts, sides.n))
    log.info("%d prompts x %d new tokens: engine %.2f s (%d prompt tokens from the prefix cache), transformers %.2f s on %s",
             len(prompts), sides.n, t_engine, prefix_hits, t_hf, device_name(args.device))
    row = {"bench": "decode", **result, "prompts": len(prompts), "max_new_tokens": sides.n, "chat": args.chat,
           **({"repeat": args.repeat, "repeat_identical": not sides.repeat_differs,
               "speedup_after_first_round": round(sides.later_ratio, 4) if sides.later_ratio else None}
              if args.repeat > 1 else {}),
           **({"speedup_ci95": speedup_interval(sides.pairs), "timed_pairs": len(sides.pairs)} if sides.pairs else {}),
           "dtype": args.dtype, "prompt_tokens": sum(len(p) for p in prompts),
           "prefix_hit_tokens": prefix_hits, "checkpoint": ident,
           "device_name": device_name(args.device), "commit": git_commit()}
    record(args.results, row)
    print(json.dumps(row))  # the row as recorded: with the rounds, the checkpoint and the commit
    return 0


if __name__ == "__main__":
    sys.exit(main())
