"""Verifying ahead (spec/verify_ahead.py): the next greedy speculative verify launched before the host
reads this one. On the CPU the static steps run eagerly (static_batches=True, verify_ahead=True: the
same bookkeeping without the overlap); with CANTATA_TEST_DEVICE=cuda they are graphs.

Against the same engine without it, on the same weights and drafter: greedy tokens identical for a batch
of requests of different lengths, cut at EOS, stop strings and max_tokens, with requests arriving and
aborted between steps, a policy switch mid-run, a tool-call tag cutting runs and a sequence crossing a
context-width bucket; the steps ahead were used and, where the step changed, discarded; the KV
invariants (pointer, reservations, zero tails past them, the prefix cache's blocks) hold after every step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from policies.policy import SpeculationPolicy
from specialists.engine import Engine
from specialists.sampling import SamplingParams
from tests.test_decode_ahead import CUDA, DEV, ROOT, _drive, _prompts


def _engine(domain: str, ahead: bool, max_num_seqs: int = 4) -> Engine:
    flags = {"cuda_graphs": True} if CUDA else {"static_batches": True, "pad_batches": True}
    return Engine.from_pretrained(ROOT / "deploy" / "models" / domain, device=DEV, dtype=torch.float32,
                                  max_num_seqs=max_num_seqs, num_blocks=256, verify_ahead=ahead,
                                  policy=SpeculationPolicy(mode="on", num_speculative_tokens=3), **flags)


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=41, ignore_eos=True), SamplingParams(max_tokens=9, ignore_eos=True),
            SamplingParams(max_tokens=40), SamplingParams(max_tokens=31, ignore_eos=True, stop=["\n\n"]),
            SamplingParams(max_tokens=18, ignore_eos=True), SamplingParams(max_tokens=27, ignore_eos=True)]


@pytest.mark.parametrize("domain", ["shell", "build"])
def test_verifying_ahead_gives_the_same_tokens(domain: str) -> None:
    ref, eng = _engine(domain, False), _engine(domain, True)
    prompts, params = _prompts(eng, domain, 6), _params()
    plan = dict(arrive={0: [0, 1, 2], 3: [3], 9: [4, 5]}, abort={12: 4}, switch={})
    want = _drive(ref, prompts, params, **plan)
    got = _drive(eng, prompts, params, **plan)
    a, b = got.pop("r4"), want.pop("r4")  # aborted: the step ahead admitted it a step later, so it may have fewer tokens
    assert a == b[:len(a)] and a
    assert got == want
    assert len(got["r0"]) == 41 and len(got["r1"]) == 9
    stats = eng.stats["verify_ahead"]
    assert stats["used"] >= 5 and stats["discarded"] >= 1, stats
    assert stats["launched"] == stats["used"] + stats["discarded"]
    assert ref.stats["verify_ahead"] == {"launched": 0, "used": 0, "discarded": 0}
    assert eng.totals.as_dict()["drafted"] > 0 and eng.speculator.ahead_used > 0
    assert not eng.kv.sequence_ids()  # every sequence's blocks went back (the reservations ahead too)


def test_a_policy_switch_and_a_trigger_cut_discard_the_step_ahead() -> None:
    """Speculation switched off and on while a verify ahead is in flight, and a tool-call tag (a token
    the model emits mid-run) cutting a run: the step ahead is discarded (its KV past each pointer rolled
    back, zero tails checked every step), the drafter's outputs of the step before restored, and the
    tokens stay those of the engine without it."""
    ref, eng = _engine("shell", False), _engine("shell", True)
    prompts = _prompts(eng, "shell", 1)
    params = [SamplingParams(max_tokens=60, ignore_eos=True)]
    first = ref.generate(prompts, params[0])[0].token_ids
    tag = [t for i, t in enumerate(first) if i >= 12 and t not in first[:i] + prompts[0]][-1]  # new after 12 tokens
    for e in (ref, eng):
        e.triggers = replace(e.triggers, tool_open_id=tag)
    plan = dict(arrive={0: [0]}, abort={}, switch={3: "off", 5: "on"})
    want = _drive(ref, prompts, params, **plan)
    assert _drive(eng, prompts, params, **plan) == want
    assert tag in want["r0"]
    stats = eng.stats["verify_ahead"]
    assert stats["discarded"] >= 2 and stats["used"] >= 1, stats  # the switch's and the cut's


def test_sequences_crossing_a_width_bucket_stay_exact() -> None:
    """Prompts ending just below a context-width bucket (256): the verify ahead is built at the width its
    longest possible context needs, while the step the host builds may be narrower (fewer drafts kept):
    such a step ahead is discarded, never run at a width the engine without it would not use (shell's
    prompts under build's drafter: fewer drafts kept than on build's own, so some crossings discard)."""
    ref, eng = _engine("build", False), _engine("build", True)
    text = sum(_prompts(eng, "shell", 8), [])
    prompts = [text[:n] for n in range(240, 252)]
    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * len(prompts)
    for i in range(len(prompts)):  # one at a time: each crosses the bucket alone
        plan = dict(arrive={0: [i]}, abort={}, switch={})
        assert _drive(eng, prompts, params, **plan) == _drive(ref, prompts, params, **plan)
    stats = eng.stats["verify_ahead"]
    assert stats["used"] >= 10 and stats["discarded"] >= 1, stats


def test_hybrids_do_not_verify_ahead() -> None:
    """A hybrid's verify commits its Mamba states on the host: it never goes ahead."""
    eng = _engine("cpp", True)
    eng.generate(_prompts(eng, "cpp", 2), SamplingParams(max_tokens=12, ignore_eos=True))
    assert eng.stats["verify_ahead"]["launched"] == 0 and eng.totals.as_dict()["drafted"] > 0
