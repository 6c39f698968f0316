"""bench.decode's two sides: the engines (and transformers) generating, timed batch by batch, with
--spec-k two identical engines that swap the plain and speculative sides (bench/decode.py says why)."""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

WARMUP_TOKENS = 8


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def engine_generate(engine, prompts: list[list[int]], max_new_tokens: int, stats: list | None = None) -> list[list[int]]:
    """Greedy, EOS ignored: exactly max_new_tokens ids per prompt, in prompt order. stats: gets each
    request's (RequestStats, output length)."""
    from specialists.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params, use_tqdm=False)
    if stats is not None:
        stats.extend((o.stats, len(o.token_ids)) for o in outs)
    return [list(o.token_ids) for o in outs]


@torch.no_grad()
def hf_generate(hf, prompts: list[list[int]], max_new_tokens: int, pad_id: int, device: str) -> list[list[int]]:
    """One left-padded batch (unpadded when all prompts have one length, e.g. B = 1); greedy, EOS ignored."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    out = hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                      min_new_tokens=0, do_sample=False, pad_token_id=pad_id)
    return [row.tolist() for row in out[:, width:].cpu()]


def timed(fn, batches: list[list[list[int]]], device: str, desc: str, quiet: bool = False) -> tuple[list[list[int]], float]:
    """Runs fn on every batch; returns the outputs in order and the summed wall time of the calls."""
    outs: list[list[int]] = []
    total = 0.0
    for batch in tqdm(batches, desc=desc, unit="batch", file=sys.stderr, disable=quiet):
        _sync(device)
        t0 = time.perf_counter()
        res = fn(batch)
        _sync(device)
        total += time.perf_counter() - t0
        outs.extend(res)
    return outs, total


@dataclass
class Sides:
    """What a run compares: the engine, its speculative twin (with --spec-k) and transformers, each
    generating `n` new tokens per prompt."""

    engine: Any
    spec_engine: Any | None
    hf: Any
    pad_id: int
    device: str
    n: int
    policy: Any = None  # the speculative side's policy (with --spec-k: both engines can take it)
    repeat_differs: bool = False  # a later --repeat round gave other tokens than the first
    later_ratio: float | None = None  # plain / speculative time over the rounds after the first
    pairs: list = field(default_factory=list)  # (plain s, speculative s) of each batch and round, timed back to back

    gates: dict = field(default_factory=dict)  # id(engine) -> (its speculating gate, its plain gate)
    request_stats: list = field(default_factory=list)  # (RequestStats, tokens) of run_engine's requests
    timed_stats: list = field(default_factory=list)  # those of the timed run (without --spec-k)

    def side(self, eng: Any, speculate: bool) -> None:
        """With --spec-k both engines have the drafter: either takes either side, each with a gate of its
        own, swapped in whole: the speculating gate keeps its window, status and figures across the
        plain side's batches, as a served engine's would (a policy toggle would restart its window and
        re-probe after every swap: 134 speculative steps at batch 1 where one window's 26 judge it)."""
        eng.gate = self.gate_of(eng, speculate)

    def gate_of(self, eng: Any, speculate: bool) -> Any:
        if id(eng) not in self.gates:
            eng.set_policy(self.policy)
            off = type(eng.gate)(self.policy.model_copy(update={"mode": "off"}), paired=eng.gate.paired)
            self.gates[id(eng)] = (eng.gate, off)
        return self.gates[id(eng)][0 if speculate else 1]

    def run_as(self, eng: Any, speculate: bool, batch: list[list[int]], max_new: int | None = None) -> list[list[int]]:
        self.side(eng, speculate)
        return engine_generate(eng, batch, self.n if max_new is None else max_new)

    def run_engine(self, batch: list[list[int]], max_new: int | None = None) -> list[list[int]]:
        return engine_generate(self.engine, batch, self.n if max_new is None else max_new, self.request_stats)

    def run_spec(self, batch: list[list[int]], max_new: int | None = None) -> list[list[int]]:
        return engine_generate(self.spec_engine, batch, self.n if max_new is None else max_new)

    def run_hf(self, batch: list[list[int]], max_new: int | None = None) -> list[list[int]]:
        return hf_generate(self.hf, batch, self.n if max_new is None else max_new, self.pad_id, self.device)


def warm_up(sides: Sides, batches: list[list[list[int]]], skip_hf: bool) -> None:
    """CUDA graphs of every decode / verify shape, both engines, before anything is timed (0 on CPU);
    then every batch's prefill and decode shapes, both sides (a kernel's first call with a new shape
    may compile it; the side that met it first in the timed run would pay). On reversed prompts, so
    that the timed run gets no prefix-cache hits from the warm-up (only from prompts sharing a prefix).
    Each engine captures under the speculating side's policy (its K and k_choices): the first engine,
    left at mode off with the default K, captured K=3 graphs where the run verified K=5, and the
    shapes the warm-up's short runs never reached (batch 4, 2 and 1 at width 512, the tails of batches)
    were captured inside the timed run, ~20 ms a bucket on that side (H200, cpp, session 30)."""
    for eng in (e for e in (sides.engine, sides.spec_engine) if e is not None):
        if sides.spec_engine is not None:
            sides.side(eng, True)
        eng.capture_graphs()  # its speculative shapes too, under mode off: either engine runs either side
    warm_n = min(sides.n, WARMUP_TOKENS)
    for batch in tqdm(batches, desc="warm-up", unit="batch", file=sys.stderr):
        warm = [p[::-1] for p in batch]
        if sides.spec_engine is None:
            sides.run_engine(warm, warm_n)
            continue
        for eng in (sides.engine, sides.spec_engine):  # each engine both ways: either runs either side
            sides.run_as(eng, False, warm, warm_n)
            sides.run_as(eng, True, warm, warm_n)
    if sides.spec_engine is not None:
        sides.engine.totals = sides.spec_engine.totals = type(sides.engine.totals)()  # count the timed run only
        for eng in (sides.engine, sides.spec_engine):  # the gates judge afresh, as after Engine.warmup
            sides.gate_of(eng, True).set_policy(sides.policy, fresh=True)
            eng.step_times = type(eng.step_times)()
    if not skip_hf:
        sides.run_hf([p[::-1] for p in batches[0]], warm_n)
    _sync(sides.device)


def _role(i: int, r: int, n: int) -> int:
    """Which engine runs batch i's plain side in round r (of n batches): the same one in every round,
    the engines alternating batch by batch, so a later round of a batch hits only what that side
    cached: a speculating hit stops at blocks holding drafter entries, and when the engines swapped
    sides every round the plain side cached each batch's prompts without them for the speculating
    side to compute again (~60 ms a batch-8 prefill against ~5 for a hit on build, CPU), while the
    plain side hit the speculating side's blocks. An odd count's last batch alternates by round."""
    return (i + (r if n % 2 and i == n - 1 else 0)) % 2


def timed_engines(sides: Sides, batches: list[list[list[int]]], spec_k: int | None,
                   repeat: int = 1) -> tuple[list, list, float, float]:
    """The engine's outputs and time, and the speculative engine's ([] and 0.0 without one); with
    repeat, the mean time of a round."""
    if sides.spec_engine is None:
        sides.request_stats.clear()
        ours, t_engine = timed(sides.run_engine, batches, sides.device, "engine")
        sides.timed_stats = list(sides.request_stats)
        return ours, [], t_engine, 0.0
    if len(batches) * repeat % 2:  # the engines alternate (_role): an odd count puts one on a side once more
        print(f"note: {len(batches)} batch(es) x {repeat} round(s) is odd: the two engines do not run each side equally "
              "often (two instances differ in speed by up to 23% on a CPU); an even --repeat balances them", file=sys.stderr)
    ours, spec, t_engine, t_spec = [], [], 0.0, 0.0  # side by side, batch after batch: noise hits both alike
    engines, later = (sides.engine, sides.spec_engine), [0.0, 0.0]  # later: the rounds after the first
    for i, batch in enumerate(tqdm(batches, desc=f"engine / speculative K={spec_k}", unit="batch", file=sys.stderr)):
        first = None
        for r in range(repeat):
            a, b = engines if _role(i, r, len(batches)) == 0 else engines[::-1]
            runs = {}  # and which side runs first swaps too: neither side always runs second
            for speculate in ((False, True) if (i // 2 + r) % 2 == 0 else (True, False)):
                runs[speculate] = timed(lambda x: sides.run_as(b if speculate else a, speculate, x), [batch],
                                        sides.device, "", quiet=True)
            (plain, dt), (out, dt_spec) = runs[False], runs[True]
            t_engine += dt
            t_spec += dt_spec
            sides.pairs.append((dt, dt_spec))
            later[0] += dt if r else 0.0
            later[1] += dt_spec if r else 0.0
            if first is None:
                first = (plain, out)
                ours.extend(plain)
                spec.extend(out)
            elif (plain, out) != first:  # a later round must give the first round's tokens
                sides.repeat_differs = True
    sides.later_ratio = later[0] / later[1] if later[1] > 0 else None
    sides.side(sides.engine, False)  # the roles back (later probes run engine plain, spec_engine speculating)
    sides.side(sides.spec_engine, True)
    return ours, spec, t_engine / repeat, t_spec / repeat


def speedup_interval(pairs: list[tuple[float, float]], draws: int = 2000, seed: int = 0) -> list[float] | None:
    """A 95% bootstrap interval of the speed-up (summed plain time over summed speculative time) over
    the (plain, speculative) pairs of a run: each pair ran back to back on one batch, so the machine's
    drift hits both; pairs drawn with replacement `draws` times (a fixed seed: the same run gives the
    same interval). Two sides running identical plain steps (batch 32, nothing speculating) read 0.94-1.20
    in single H100/H200 runs: a speed-up is only "above" or "below" 1.0 outside this interval."""
    if len(pairs) < 2:
        return None
    rng = random.Random(seed)
    stats = []
    for _ in range(draws):
        draw = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        spec = sum(b for _, b in draw)
        stats.append(sum(a for a, _ in draw) / spec if spec > 0 else float("inf"))
    stats.sort()
    return [round(stats[int(0.025 * draws)], 4), round(stats[int(0.975 * draws) - 1], 4)]
