"""bench.decode at real sizes: --shape NAME (random weights of a named shape, bench/shapes.py) and the
figures against the memory-bandwidth bound (with --shape, or --bound for --model DIR).

Added to the result line:
  shape, params            the shape's name (null for --model) and its parameter count (tied counted once)
  weight_bytes             bytes of weights one decode step reads (bench/shapes.py: every parameter once,
                           the input embedding only when tied to the lm_head)
  bandwidth_tb_s           the device's measured bandwidth in this run, TB/s: the larger of a D2D copy
                           (bytes read + written) and a read-reduce (bytes read), each a median of 10
  bound_ms                 weight_bytes / bandwidth: the fastest a batch-1 decode step can be
  ms_per_token             1000 * the engine's timed seconds / the tokens one sequence waited for (each
                           batch's longest output, summed; the prefill's time included)
  ratio_to_bound           ms_per_token / bound_ms
  tpot_ms, ttft_ms         without --spec-k, medians over the timed requests: first token to last over the
                           tokens after the first (decode only: the time per output token peers report), and
                           arrival to first token (queue and prefill); tpot_ratio_to_bound = tpot_ms / bound_ms
  engine_steps             those tokens (named for the one-token steps they were before multi-step decodes)
  decode_steps             the plain engine's greedy decodes per step (specialists/multistep.py; 4 on CUDA)
  ms_per_token_one_step    with decode_steps > 1: the plain engine again at one token per step, same batches
  multistep_speedup        that time / the multi-step time
  decode_step_ms           median of a one-token decode-only step of the plain engine, device synchronized
With --spec-k K (a separate pass, the device synchronized around every step and every part timed):
  verify_over_decode       median target forward over K+1 tokens per row (the verify, with the drafter's
                           rebuild where the engine runs it in the same graph) / median 1-token forward
  spec_step_over_decode    median whole speculative step (chain, verify, accept, host) / plain step
  draft_over_target        median drafter chain seconds per draft / median 1-token target forward
  drafts_random            true for --shape: drafts of a random drafter, so only the cost ratios mean anything
With --profile FILE: torch.profiler over 16 decode steps of the plain engine (bench/step_profile.py); with
--spec-k also over 16 steps of the speculative engine, into FILE's name + .spec (profile_spec).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import tempfile
from pathlib import Path
from typing import Any, Iterator

from bench.decode_sides import timed
from bench.shapes import SHAPES, SMALL_SHAPES, build_checkpoint, parameter_count, shape_config, weight_bytes
from bench.step_profile import profile_decode
from bench.step_timing import StepProbe, decode_records, measure_bandwidth, median_or_none

log = logging.getLogger("bench.decode")

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = ROOT / "bench" / "data" / "shell" / "prompts.jsonl"
PROFILE_STEPS = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape-dir", type=Path, default=None,
                        help="build the --shape checkpoint here (reused when it holds the same build; default: a temp dir)")
    parser.add_argument("--bound", action="store_true",
                        help="with --model: also the bandwidth-bound figures (always on with --shape or --profile)")
    parser.add_argument("--hf", action="store_true",
                        help="with --shape on a CPU: run transformers for a large shape too (default: only tiny-*)")
    parser.add_argument("--bandwidth-mib", type=int, default=None, help="bandwidth buffer (default 2048 on a GPU, 256 on a CPU)")
    parser.add_argument("--profile", type=Path, default=None,
                        help=f"write a torch.profiler table over {PROFILE_STEPS} decode steps of the plain engine here")


def shape_names() -> list[str]:
    return sorted(SHAPES)


def prepare_shape(args: argparse.Namespace, dtype: Any) -> dict:
    """Builds --shape's checkpoint (args.model points at it afterwards); -> its identification."""
    out = args.shape_dir or Path(tempfile.mkdtemp(prefix=f"cantata-{args.shape}-"))
    k = args.spec_k if args.spec_k is not None and args.spec_k >= 1 else None
    log.info("building random %s weights (%s) on %s into %s", args.shape, args.dtype, args.device, out)
    args.model = build_checkpoint(args.shape, out, dtype, args.device, drafter_k=k)
    if args.prompts is None:
        args.prompts = DEFAULT_PROMPTS
    if args.device == "cpu" and args.shape not in SMALL_SHAPES and not args.hf:
        args.skip_hf = True  # transformers at 1B on a CPU takes minutes
    return {"path": str(args.model), "shape": args.shape, "random_weights": True, "seed": 0,
            "drafter": "random" if k else None}


def _config(args: argparse.Namespace) -> Any:
    if args.shape:
        return shape_config(args.shape)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(args.model), local_files_only=True)


def _step_figures(sides: Any, batches: list, args: argparse.Namespace) -> dict:
    """Median step and forward times of the plain engine and (with --spec-k) of the speculative one."""
    chains: dict[str, int] = {}

    def probe(engine: Any, run: Any) -> list:
        with StepProbe(engine, args.device) as p:
            for batch in batches:
                run(batch)
        chains.update(p.chain_calls)
        return p.records

    with one_token_steps(sides.engine.runner):  # a decode step here is one token: what a verify of K+1 is compared with
        plain = decode_records(probe(sides.engine, sides.run_engine), 1)
    step = median_or_none([r.seconds for r in plain])
    fwd = median_or_none([r.forward_s for r in plain])
    out: dict = {"decode_step_ms": _ms(step)}
    if sides.spec_engine is None:
        return out
    spec = decode_records(probe(sides.spec_engine, sides.run_spec), 1 + args.spec_k)
    verify = median_or_none([r.forward_s for r in spec])
    spec_step = median_or_none([r.seconds for r in spec])
    chain = median_or_none([r.chain_s / r.chains / args.spec_k for r in spec if r.chains])
    out.update(verify_step_ms=_ms(verify), verify_over_decode=_ratio(verify, fwd),
               spec_step_over_decode=_ratio(spec_step, step), draft_over_target=_ratio(chain, fwd),
               timed_steps={"decode": len(plain), "verify": len(spec), "chain_calls": chains})
    if args.shape:
        out["drafts_random"] = True
    return out


def _sig(x: float, digits: int = 6) -> float:
    return float(f"{x:.{digits}g}")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 4)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


@contextlib.contextmanager
def one_token_steps(runner: Any) -> Iterator[None]:
    """The plain engine at one token per step (no multi-step decodes) inside the block."""
    steps, runner.decode_steps = runner.decode_steps, 1
    try:
        yield
    finally:
        runner.decode_steps = steps


def _one_step_figures(sides: Any, batches: list, args: argparse.Namespace, t_engine: float, tokens: int) -> dict:
    """With multi-step decodes (specialists/multistep.py) on: the plain engine timed again at one
    token per step, right after the main run (the same batches): the multi-step gain as a ratio."""
    steps = sides.engine.runner.decode_steps
    out: dict = {"decode_steps": steps}
    if steps > 1 and tokens:
        with one_token_steps(sides.engine.runner):
            _, t_one = timed(sides.run_engine, batches, args.device, "", quiet=True)
        out.update(ms_per_token_one_step=round(1e3 * t_one / tokens, 4), multistep_speedup=_ratio(t_one, t_engine))
    return out


def latency_figures(stats: list, bound_ms: float) -> dict:
    """tpot_ms, ttft_ms and tpot_ratio_to_bound (module docstring) from (RequestStats, tokens) pairs;
    {} without them (a --spec-k run)."""
    tpots = [(st.finished_time - st.first_token_time) / (n - 1) for st, n in stats
             if n > 1 and st.finished_time is not None and st.first_token_time is not None]
    ttfts = [st.ttft_s for st, _ in stats if st.ttft_s is not None]
    if not tpots:
        return {}
    tpot = _ms(median_or_none(tpots))
    return {"tpot_ms": tpot, "ttft_ms": _ms(median_or_none(ttfts)), "tpot_ratio_to_bound": _ratio(tpot, bound_ms)}


def bound_figures(sides: Any, batches: list, args: argparse.Namespace, t_engine: float, steps: int) -> dict:
    """The result line's additions (module docstring), measured on this device now. steps: the decode
    tokens one sequence waited for (each batch's longest output, summed)."""
    config = _config(args)
    wbytes = weight_bytes(config, sides.engine.model.dtype)
    bw = measure_bandwidth(args.device, args.bandwidth_mib)
    bandwidth = max(bw["copy_tb_s"], bw["read_tb_s"])
    bound_ms = wbytes / (bandwidth * 1e12) * 1e3
    ms_per_token = 1e3 * t_engine / steps if steps else None
    result = {"shape": args.shape, "params": parameter_count(config), "weight_bytes": wbytes,
              "bandwidth_tb_s": _sig(bandwidth),
              "bandwidth": {k: v if k == "buffer_mib" else _sig(v) for k, v in bw.items()}, "bound_ms": _sig(bound_ms),
              "ms_per_token": None if ms_per_token is None else round(ms_per_token, 4), "engine_steps": steps,
              "ratio_to_bound": _ratio(ms_per_token, bound_ms)}
    result.update(latency_figures(sides.timed_stats, bound_ms))
    result.update(_one_step_figures(sides, batches, args, t_engine, steps))
    result.update(_step_figures(sides, batches, args))
    if args.profile is not None:
        result["profile"] = profile_decode(sides.engine, batches[0], PROFILE_STEPS, args.profile, args.device)
        if sides.spec_engine is not None:  # and the speculative steps (chain, verify, accept) beside it
            spec_path = args.profile.with_name(args.profile.stem + ".spec" + args.profile.suffix)
            result["profile_spec"] = profile_decode(sides.spec_engine, batches[0], PROFILE_STEPS, spec_path, args.device,
                                                    label="speculative engine")
    return result
