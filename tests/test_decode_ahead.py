"""Decoding ahead (spec/decode_ahead.py): the next plain multi-step decode launched before the host
reads this one. On the CPU the static steps run eagerly (static_batches=True, decode_ahead=True: the
same bookkeeping without the overlap); with CANTATA_TEST_DEVICE=cuda they are graphs.

Against the same engine without it, on the same weights: greedy tokens identical for a batch of
requests of different lengths, cut at EOS, stop strings and max_tokens S does not divide, with
requests arriving and aborted between steps and a policy switch mid-run; the steps ahead were used
and, where the batch changed, discarded; the KV invariants (pointer, reservations, zero tails, the
prefix cache's blocks) hold after every step. A hybrid (cpp, python: Mamba layers) decodes ahead too,
its Mamba states after every step equal to the plain engine's.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from policies.policy import SpeculationPolicy
from specialists.engine import Engine
from specialists.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DEV = os.environ.get("CANTATA_TEST_DEVICE", "cpu")
CUDA = DEV.startswith("cuda")
STEPS = 4


def _engine(domain: str, ahead: bool, mode: str = "off", max_num_seqs: int = 4) -> Engine:
    flags = {"cuda_graphs": True} if CUDA else {"static_batches": True, "pad_batches": True}
    engine = Engine.from_pretrained(ROOT / "deploy" / "models" / domain, device=DEV, dtype=torch.float32,
                                    max_num_seqs=max_num_seqs, num_blocks=256, decode_steps=STEPS, decode_ahead=ahead,
                                    policy=SpeculationPolicy(mode="on"), **flags)  # with its drafter: a switch is live
    engine.gate.set_policy(SpeculationPolicy(mode=mode))
    return engine


def _prompts(engine: Engine, domain: str, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in (ROOT / "bench" / "data" / domain / "prompts.jsonl").read_text().splitlines()]
    return [engine.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"][-60:] for r in rows[:n]]


def _drive(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], arrive: dict[int, list[int]],
           abort: dict[int, int], switch: dict[int, str]) -> dict[str, list[int]]:
    """Runs the engine step by step: prompts[i] arrives before step arrive-key (index lists), request
    abort[step] is aborted before that step, the policy mode switches to switch[step]; every step ends
    with the KV cache's full invariants. -> request id -> output tokens."""
    out: dict[str, list[int]] = {}
    step = 0
    pending = {s: list(ids) for s, ids in arrive.items()}
    while step <= max(pending, default=0) or engine.has_unfinished():
        for i in pending.pop(step, []):
            engine.add_request(prompts[i], params[i], f"r{i}")
        if step in abort:
            engine.abort(f"r{abort[step]}")
        if step in switch:
            engine.gate.set_policy(engine.gate.policy.model_copy(update={"mode": switch[step]}))
        for o in engine.step():
            out[o.request_id] = list(o.token_ids)
        engine.kv.check_invariants()
        step += 1
    return out


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=23, ignore_eos=True), SamplingParams(max_tokens=9, ignore_eos=True),
            SamplingParams(max_tokens=40), SamplingParams(max_tokens=31, ignore_eos=True, stop=["\n\n"]),
            SamplingParams(max_tokens=18, ignore_eos=True), SamplingParams(max_tokens=27, ignore_eos=True)]


@pytest.mark.parametrize("domain", ["shell", "cpp"])
def test_decoding_ahead_gives_the_plain_engines_tokens(domain: str) -> None:
    ref, eng = _engine(domain, False), _engine(domain, True)
    prompts, params = _prompts(eng, domain, 6), _params()
    plan = dict(arrive={0: [0, 1, 2], 3: [3], 9: [4, 5]}, abort={12: 4}, switch={})
    want = _drive(ref, prompts, params, **plan)
    got = _drive(eng, prompts, params, **plan)
    a, b = got.pop("r4"), want.pop("r4")  # aborted: the step ahead admitted it a step later, so it has fewer tokens
    assert a == b[:len(a)] and a
    assert got == want
    assert len(got["r0"]) == 23 and len(got["r1"]) == 9
    stats = eng.stats["decode_ahead"]
    assert stats["used"] >= 5, stats
    assert stats["launched"] >= stats["used"] > 0
    assert ref.stats["decode_ahead"] == {"launched": 0, "used": 0, "discarded": 0}
    assert eng.steps <= ref.steps + 2  # at most a step more for each of the two arrivals that waited
    assert not eng.kv.sequence_ids()  # every sequence's blocks went back (the reservations ahead too)


@pytest.mark.parametrize("domain", ["build", "python"])
def test_a_policy_switch_discards_the_step_ahead_and_stays_exact(domain: str) -> None:
    """Speculation switched on while a step ahead is in flight: it is discarded (its KV past each
    pointer rolled back, zero tails checked every step) and the verify steps give the same tokens
    (a hybrid's verify starts from the Mamba states the plain steps committed)."""
    ref, eng = _engine(domain, False, "off"), _engine(domain, True, "off")
    prompts = _prompts(eng, domain, 3)
    params = [SamplingParams(max_tokens=37, ignore_eos=True)] * 3
    plan = dict(arrive={0: [0, 1, 2]}, abort={}, switch={4: "on", 9: "off"})
    want = _drive(ref, prompts, params, **plan)
    got = _drive(eng, prompts, params, **plan)
    assert got == want
    stats = eng.stats["decode_ahead"]
    assert stats["discarded"] >= 1 and stats["used"] >= 1, stats


def test_auto_holding_speculation_off_decodes_ahead_and_a_probe_discards_it() -> None:
    """`auto` over its batch limit holds speculation off (plain multi-step steps, decoded ahead); once
    the batch shrinks to the limit it probes (speculates) at once (cooldown 0): the step ahead is
    discarded and the tokens stay the plain engine's."""
    ref = _engine("shell", False)
    eng = _engine("shell", True)
    eng.gate.set_policy(SpeculationPolicy(mode="auto", auto={"max_running_batch": 1, "cooldown_s": 0.0}))
    prompts = _prompts(eng, "shell", 3)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (13, 26, 41)]
    plan = dict(arrive={0: [0, 1, 2]}, abort={}, switch={})
    assert _drive(eng, prompts, params, **plan) == _drive(ref, prompts, params, **plan)
    stats = eng.stats["decode_ahead"]
    assert stats["used"] >= 2 and stats["discarded"] >= 1, stats
    assert eng.totals.as_dict()["drafted"] > 0  # it did speculate once the batch was small enough


@pytest.mark.parametrize("domain", ["shell", "cpp"])
def test_a_run_cut_short_by_a_trigger_discards_the_step_ahead(domain: str) -> None:
    """A tool-call open tag inside a run cuts it (the sequence goes on, in its tool segment): the step
    decoded ahead assumed the whole run, so it is discarded, its KV rolled back (zero tails checked
    every step), a hybrid's Mamba states those after the kept tokens, and the tokens stay the plain
    engine's. The tag here: a token the model emits often."""
    ref, eng = _engine(domain, False), _engine(domain, True)
    prompts = _prompts(eng, domain, 3)
    params = [SamplingParams(max_tokens=45, ignore_eos=True)] * 3
    first = ref.generate(prompts[:1], params[0])[0].token_ids
    tag = max(set(first[6:]), key=first[6:].count)
    for e in (ref, eng):
        e.triggers = replace(e.triggers, tool_open_id=tag)
    plan = dict(arrive={0: [0, 1, 2]}, abort={}, switch={})
    want = _drive(ref, prompts, params, **plan)
    assert _drive(eng, prompts, params, **plan) == want
    assert sum(run.count(tag) for run in want.values()) >= 2
    assert eng.stats["decode_ahead"]["discarded"] >= 1, eng.stats["decode_ahead"]


def test_new_requests_wait_one_step_and_lose_nothing() -> None:
    """A request that arrives while a step ahead is in flight is admitted after it (the step ahead's
    batch runs whole), then batched with the others; the full batch's outputs are the plain engine's."""
    eng = _engine("shell", True, max_num_seqs=8)
    ref = _engine("shell", False, max_num_seqs=8)
    prompts = _prompts(eng, "shell", 8)
    params = [SamplingParams(max_tokens=20 + 3 * i, ignore_eos=True) for i in range(8)]
    plan = dict(arrive={0: [0, 1], 2: [2], 3: [3, 4], 5: [5, 6, 7]}, abort={}, switch={})
    assert _drive(eng, prompts, params, **plan) == _drive(ref, prompts, params, **plan)
    assert eng.stats["decode_ahead"]["used"] > 0


def _states(engine: Engine) -> dict[str, tuple[int, torch.Tensor, torch.Tensor]]:
    """request id -> (committed tokens, conv, ssm) of each running sequence's Mamba slot."""
    return {rid: (engine.kv.num_computed(seq.seq_id), engine.ssm.conv[seq.ssm_slot].clone(), engine.ssm.ssm[seq.ssm_slot].clone())
            for rid, seq in engine._seqs.items() if seq.ssm_slot >= 0}


def test_a_hybrids_states_after_each_step_are_the_plain_engines() -> None:
    """A hybrid decoding ahead: after every engine step, each running sequence's Mamba state (conv and
    SSM, every layer) equals the plain engine's at the same committed length, bit for bit: the step
    ahead started from the states after this step's tokens, and this step's commit (after that launch)
    wrote the states after exactly the tokens kept (a stop string cuts a run short here)."""
    ref, eng = _engine("python", False), _engine("python", True)
    prompts = _prompts(eng, "python", 3)
    params = [SamplingParams(max_tokens=29, ignore_eos=True), SamplingParams(max_tokens=35, ignore_eos=True, stop=[")"]),
              SamplingParams(max_tokens=22, ignore_eos=True)]
    for i, p in enumerate(prompts):
        ref.add_request(p, params[i], f"r{i}")
        eng.add_request(p, params[i], f"r{i}")
    compared = 0
    while eng.has_unfinished() or ref.has_unfinished():
        ref.step()
        eng.step()
        want, got = _states(ref), _states(eng)
        for rid, (n, conv, ssm) in got.items():
            if rid in want and want[rid][0] == n:
                assert torch.equal(conv, want[rid][1]) and torch.equal(ssm, want[rid][2]), (rid, n)
                compared += 1
        eng.kv.check_invariants()
    assert compared >= 8
    assert eng.stats["decode_ahead"]["used"] >= 3, eng.stats["decode_ahead"]
