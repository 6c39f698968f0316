"""Speculation switched on and off in the middle of requests (issue 20 item 4): a policy flip every
few engine steps (on K=3, off, on K=1, on K=2, ...) under a batch of mixed requests, some arriving
mid-way, must leave every state exactly as plain decoding would: greedy tokens equal a plain
engine's, for a Llama (shell) and a Mamba2 hybrid (cpp, whose SSM state a stale verify would
corrupt), eagerly and as static batches (the CUDA-graph path on a CPU); the engine asserts the KV
pointer == committed length after every step and the pool is whole at the end."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from policies.policy import SpeculationPolicy
from specialists.engine import Engine
from specialists.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DEV = os.environ.get("CANTATA_TEST_DEVICE", "cpu")
FLIPS = [("on", 3), ("off", 3), ("on", 1), ("on", 2), ("off", 1), ("on", 3)]


def _engine(domain: str, static: bool, mode: str) -> Engine:
    flags = {"cuda_graphs": static} if DEV.startswith("cuda") else {"static_batches": static, "pad_batches": static}
    return Engine.from_pretrained(ROOT / "deploy" / "models" / domain, device=DEV, dtype=torch.float32, max_num_seqs=6,
                                  num_blocks=256, policy=SpeculationPolicy(mode=mode, num_speculative_tokens=3), **flags)


def _requests(engine: Engine, domain: str) -> list[tuple[list[int], SamplingParams]]:
    rows = [json.loads(line) for line in (ROOT / "bench" / "data" / domain / "prompts.jsonl").read_text().splitlines()]
    prompts = [engine.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"][-(20 + 9 * i):] for i, r in enumerate(rows[:6])]
    return [(p, SamplingParams(max_tokens=14 + 5 * i, ignore_eos=i % 2 == 0)) for i, p in enumerate(prompts)]


def _run(engine: Engine, requests: list, flip_every: int | None) -> dict[str, list[int]]:
    """Half the requests at the start, the rest after 4 steps; the policy flipped every flip_every steps."""
    ids = [engine.add_request(p, sp) for p, sp in requests[:3]]
    out: dict[str, list[int]] = {}
    step = flips = 0
    while engine.has_unfinished() or len(ids) < len(requests):
        if step == 4:
            ids += [engine.add_request(p, sp) for p, sp in requests[3:]]
        if flip_every and step % flip_every == 0:
            mode, k = FLIPS[flips % len(FLIPS)]
            engine.gate.set_policy(SpeculationPolicy(mode=mode, num_speculative_tokens=k))
            flips += 1
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
        step += 1
    engine.kv.check_invariants()
    assert engine.kv.num_free_blocks() == engine.kv.pool.num_blocks
    return {str(i): out[rid] for i, rid in enumerate(ids)}


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("domain", ["shell", "cpp"])
def test_toggling_speculation_mid_request_is_exact(domain: str, static: bool) -> None:
    plain = _engine(domain, static, "off")
    want = _run(plain, _requests(plain, domain), None)
    for every in (2, 3):
        toggled = _engine(domain, static, "on")
        got = _run(toggled, _requests(toggled, domain), every)
        assert got == want, f"flip every {every} steps"
        assert toggled.totals.spec_steps > 0 and toggled.totals.steps > toggled.totals.spec_steps  # both kinds ran


@pytest.mark.parametrize("domain", ["shell", "cpp"])
def test_auto_choosing_k_per_step_is_exact(domain: str) -> None:
    """auto with k_choices: the gate picks K (1, 2 or 3) step by step from measured time; the tokens
    are plain decoding's, and several K values were verified."""
    from policies.policy import AutoGating

    plain = _engine(domain, True, "off")
    want = _run(plain, _requests(plain, domain), None)
    engine = _engine(domain, True, "on")
    engine.gate.set_policy(SpeculationPolicy(mode="auto", num_speculative_tokens=3, auto=AutoGating(
        min_acceptance=0.0, min_speedup=0.0, k_choices=(1, 2), probe_steps=2, probe_every=4)))
    assert _run(engine, _requests(engine, domain), None) == want
    ks = {key.split(":")[1] for key in engine.gate.snapshot()["seconds_per_token_by_k"]}
    assert ks == {"1", "2", "3"}
