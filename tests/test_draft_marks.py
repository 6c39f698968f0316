"""Prefix-cache hits and the drafter's entries (specialists/draft_marks.py): a block computed by plain
steps holds no drafter entries; a speculating step's hit ends before it, and once a speculating run
has written the drafter's entries for that content they are copied to the cached block and hit."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.common import read_jsonl
from policies.policy import SpeculationPolicy
from specialists.engine import Engine
from specialists.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
ON, OFF = SpeculationPolicy(mode="on", num_speculative_tokens=3), SpeculationPolicy(mode="off")


def _run(eng: Engine, prompt: list[int]) -> tuple[list[int], int, int, int]:
    """(tokens, drafted, accepted, prefix hit tokens) of one greedy request."""
    m0 = eng.metrics()
    out = eng.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    m1 = eng.metrics()
    return out.token_ids, m1["drafted"] - m0["drafted"], m1["accepted"] - m0["accepted"], m1["prefix_hit_tokens"] - m0["prefix_hit_tokens"]


@pytest.mark.parametrize("name", ["build", "cpp"])  # Llama, and a hybrid (hits also end at a Mamba state)
def test_a_prefix_cached_by_plain_steps_is_hit_once_the_drafter_wrote_it(name: str) -> None:
    model = ROOT / "deploy" / "models" / name
    eng = Engine.from_pretrained(model, max_num_seqs=1, policy=ON)
    cold = Engine.from_pretrained(model, max_num_seqs=1, policy=ON, enable_prefix_cache=False)
    prompts = [eng.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
               for r in read_jsonl(ROOT / "bench" / "data" / name / "prompts.jsonl", 4)]
    for prompt in prompts:
        ref = _run(cold, prompt)
        eng.set_policy(OFF)
        plain = _run(eng, prompt)
        assert _run(eng, prompt)[3] > 0  # decoding plainly, a hit takes every cached block
        eng.set_policy(ON)
        second = _run(eng, prompt)  # speculating: the plain blocks are computed again, drafter included
        assert second[3] == 0 and second == ref  # the same drafts and acceptance as without a cache
        third = _run(eng, prompt)  # the drafter's entries were copied to the cached blocks: a hit
        assert third[3] > 0 and third[0] == ref[0] == plain[0]
        assert third[2] >= ref[2] - 2  # acceptance as without a cache (not the ~40% lower of a bare hit)
    assert eng.scheduler.draft_marks.copied > 0



def test_a_request_that_ends_in_its_first_plain_step_marks_nothing() -> None:
    """A request that finishes in the step of its prefill (max_tokens 1) under the gate's fallback wrote
    no drafter entries: its blocks stay unmarked, and a speculating request with that prompt computes it
    again (drafted_all was updated after the outputs, so such a request marked its blocks as holding
    entries nobody wrote, and a later hit drafted over them)."""
    model = ROOT / "deploy" / "models" / "build"
    eng = Engine.from_pretrained(model, max_num_seqs=1, policy=SpeculationPolicy(mode="auto", num_speculative_tokens=3))
    prompt = eng.tokenizer(read_jsonl(ROOT / "bench" / "data" / "build" / "prompts.jsonl", 1)[0]["prompt"],
                           add_special_tokens=False)["input_ids"]
    decide = eng.gate.decide
    eng.gate.decide = lambda batch, guided=False: "fallback"
    eng.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    eng.gate.decide = decide
    eng.set_policy(OFF)
    assert _run(eng, prompt)[3] > 0  # the blocks are cached: a plain step hits them
    eng.set_policy(ON)
    assert _run(eng, prompt)[3] == 0  # not marked: a speculating step computes them again
