"""Time to first token of requests that share a prefix (bench.decode --prefix-ttft).

Prompts such as bench/data/cpp/shared_prefix.jsonl share a long head (one system prompt and tool
list) and differ in the question. Each round loads two fresh engines, one with the prefix cache on
and one with it off, warms both on the reversed prompts (no block of those is a prefix of a real
prompt), then sends the prompts one at a time in file order. On the cached engine the first request
prefills everything and later ones find the shared head in the cache (for a hybrid: KV and the Mamba
state snapshot, state/ssm_snapshots.py); the uncached engine prefills everything every time, so the
same requests measure what the cache saves rather than warm-up order. Figures are medians over the
rounds (and over the later requests): ttft_first_ms, ttft_later_ms, ttft_later_nocache_ms,
ttft_later_speedup (nocache / cached), prefix_hit_tokens_first / _later (mean per request), and
identical_prefix_cache (greedy tokens with the cache equal those without it).
"""

from __future__ import annotations

import statistics
import sys
from typing import Any, Callable

from tqdm import tqdm

WARMUP_TOKENS = 4


def _alone(engine: Any, prompts: list[list[int]], max_new: int) -> tuple[list[float], list[int], list[list[int]]]:
    """Each prompt alone, in order, greedy with EOS ignored -> TTFTs (s), prefix-hit tokens, tokens."""
    from specialists.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    ttfts, hits, tokens = [], [], []
    for p in prompts:
        before = engine.stats["prefix_hit_tokens"]
        out = engine.generate([p], params)[0]
        ttfts.append(out.stats.ttft_s)
        hits.append(engine.stats["prefix_hit_tokens"] - before)
        tokens.append(list(out.token_ids))
    return ttfts, hits, tokens


def measure(load: Callable[[bool], Any], prompts: list[list[int]], max_new: int, rounds: int = 3) -> dict:
    """load(prefix_cache) -> a fresh engine. Needs at least two prompts."""
    if len(prompts) < 2:
        raise ValueError("--prefix-ttft needs at least two prompts")
    first, later, first_nc, later_nc, hits_first, hits_later, same = [], [], [], [], [], [], []
    for _ in tqdm(range(rounds), desc="prefix TTFT rounds", unit="round", file=sys.stderr):
        cached, plain = load(True), load(False)
        for eng in (cached, plain):
            _alone(eng, [p[::-1] for p in prompts], WARMUP_TOKENS)
        t, h, toks = _alone(cached, prompts, max_new)
        t_nc, _, toks_nc = _alone(plain, prompts, max_new)
        first.append(t[0])
        first_nc.append(t_nc[0])
        later.extend(t[1:])
        later_nc.extend(t_nc[1:])
        hits_first.append(h[0])
        hits_later.extend(h[1:])
        same.extend(a == b for a, b in zip(toks, toks_nc))
    med = lambda xs: round(1000 * statistics.median(xs), 3)  # noqa: E731 - seconds -> ms
    return {
        "ttft_rounds": rounds, "ttft_first_ms": med(first), "ttft_later_ms": med(later),
        "ttft_first_nocache_ms": med(first_nc), "ttft_later_nocache_ms": med(later_nc),
        "ttft_later_speedup": round(statistics.median(later_nc) / statistics.median(later), 3),
        "prefix_hit_tokens_first": round(statistics.mean(hits_first), 1),
        "prefix_hit_tokens_later": round(statistics.mean(hits_later), 1),
        "identical_prefix_cache": round(sum(same) / len(same), 4),
    }


def loader(args: Any, dtype: Any) -> Callable[[bool], Any]:
    """bench.decode's engine for --prefix-ttft: the speculative one with --spec-k, else the plain one
    (--prefill-graph-tokens as the timed engines take it)."""
    from policies.policy import SpeculationPolicy
    from specialists.engine import Engine

    policy = SpeculationPolicy(mode="off")
    if args.spec_k:
        policy = SpeculationPolicy(mode="on", num_speculative_tokens=args.spec_k, acceptance=args.acceptance)
    def load(prefix_cache: bool) -> Any:  # warmed up as a served engine is: every graph captured before timing
        engine = Engine.from_pretrained(str(args.model), device=args.device, dtype=dtype, max_num_seqs=1, policy=policy,
                                        enable_prefix_cache=prefix_cache, prefill_graph_tokens=args.prefill_graph_tokens)
        engine.capture_graphs()
        return engine

    return load
