"""Multi-step greedy decodes (specialists/multistep.py): `decode_steps` S one-token decodes per static
step, one host sync. On the CPU the static forward runs eagerly (static_batches=True); with
CANTATA_TEST_DEVICE=cuda the steps run as one captured graph.

Checked against the eager one-token engine on the same weights: greedy tokens identical, alone and
batched with requests of different lengths, cut at EOS, at stop strings and at a max_tokens that S
does not divide; the KV invariants hold after every step (the engine asserts them) and at the end;
fewer engine steps were run; a hybrid carries its Mamba state from step to step; sampled requests keep one
decode per step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from policies.policy import SpeculationPolicy
from specialists.engine import Engine
from specialists.options import EngineOptions, OptionsError
from specialists.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DEV = os.environ.get("CANTATA_TEST_DEVICE", "cpu")
CUDA = DEV.startswith("cuda")


def _engine(domain: str, steps: int, static: bool = True, mode: str = "off") -> Engine:
    flags = {"cuda_graphs": static} if CUDA else {"static_batches": static, "pad_batches": static}
    return Engine.from_pretrained(ROOT / "deploy" / "models" / domain, device=DEV, dtype=torch.float32, max_num_seqs=4,
                                  num_blocks=256, decode_steps=steps, policy=SpeculationPolicy(mode=mode), **flags)


def _prompts(engine: Engine, domain: str, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in (ROOT / "bench" / "data" / domain / "prompts.jsonl").read_text().splitlines()]
    return [engine.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"][-80:] for r in rows[:n]]


def _generate(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    outs = engine.generate(prompts, params)
    assert not engine.has_unfinished()
    engine.kv.check_invariants()
    return outs


@pytest.fixture(scope="module")
def reference() -> Engine:
    return _engine("shell", 1, static=False)


@pytest.mark.parametrize("steps", [2, 4, 5])
def test_multistep_equals_one_token_decodes(reference: Engine, steps: int) -> None:
    engine = _engine("shell", steps)
    assert engine.runner.decode_steps == steps
    prompts = _prompts(engine, "shell", 3)
    params = [SamplingParams(max_tokens=21, ignore_eos=True), SamplingParams(max_tokens=9, ignore_eos=True),
              SamplingParams(max_tokens=30)]  # one stops at EOS (or runs to 30)
    want = _generate(reference, prompts, params)
    steps_before = engine.steps
    got = _generate(engine, prompts, params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == w.finish_reason
        assert g.text == w.text
    assert [len(g.token_ids) for g in got][:2] == [21, 9]
    # 3 prefills, then at most ceil(30 / steps) + a few multi-steps: far fewer than 30 one-token steps
    assert engine.steps - steps_before <= 3 + -(-30 // steps) + 2


def test_multistep_cuts_at_stop_strings(reference: Engine) -> None:
    engine = _engine("shell", 4)
    prompt = _prompts(engine, "shell", 1)
    free = _generate(reference, prompt, [SamplingParams(max_tokens=24, ignore_eos=True)])[0]
    stop = engine.tokenizer.decode(free.token_ids[9:11])  # text the 10th and 11th tokens make: a cut mid-run
    assert stop.strip() and stop in free.text
    params = [SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop])]
    want = _generate(reference, prompt, params)[0]
    got = _generate(engine, prompt, params)[0]
    assert got.finish_reason == want.finish_reason == "stop"
    assert got.text == want.text and got.token_ids == want.token_ids


@pytest.mark.parametrize("steps", [3, 4])
def test_a_hybrid_multistep_carries_its_mamba_state(steps: int) -> None:
    """cpp (Mamba2 + attention): each step of a multi-step decode reads the Mamba state the step
    before left (not the committed one), and the commit keeps the state after exactly the kept tokens:
    the tokens equal one-token decodes', also for runs cut at EOS and at a max_tokens that S does not
    divide, and a second request on the same slots starts from clean states."""
    reference, engine = _engine("cpp", 1, static=False), _engine("cpp", steps)
    assert engine.runner.decode_steps == steps
    prompts = _prompts(engine, "cpp", 3)
    params = [SamplingParams(max_tokens=23, ignore_eos=True), SamplingParams(max_tokens=10, ignore_eos=True),
              SamplingParams(max_tokens=30)]
    want = _generate(reference, prompts, params)
    before = engine.steps
    got = _generate(engine, prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    assert engine.steps - before <= 3 + -(-30 // steps) + 2
    again = _generate(engine, prompts[1:2], params[:1])[0]  # slots reused
    assert again.token_ids == _generate(reference, prompts[1:2], params[:1])[0].token_ids


def test_sampled_requests_decode_one_token_per_step() -> None:
    engine = _engine("shell", 4)
    prompt = _prompts(engine, "shell", 1)
    before = engine.steps
    out = _generate(engine, prompt, [SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)])[0]
    assert len(out.token_ids) == 12
    assert engine.steps - before == 12  # a prefill, then one sampled token per step


@pytest.mark.parametrize("bad", [0, 17])
def test_decode_steps_is_bounded_by_the_block_size(bad: int) -> None:
    with pytest.raises(OptionsError, match="decode_steps"):
        EngineOptions(decode_steps=bad, block_size=16).resolve()


def test_a_large_prefill_keeps_the_static_buffers_and_graphs() -> None:
    """The static buffers hold the largest step the scheduler forms: 4 prompts of ~80 tokens in one
    prefill step (more than the old 256-token start) do not reallocate them, which would drop every
    captured graph and recapture them on the request path."""
    engine = _engine("shell", 4)
    generation = engine.runner.inputs.generation
    prompts = [p * 4 for p in _prompts(engine, "shell", 4)]  # ~320 tokens each, ~1280 in the first step
    _generate(engine, prompts, [SamplingParams(max_tokens=6, ignore_eos=True)] * 4)
    assert sum(len(p) for p in prompts) > 1000
    assert engine.runner.inputs.generation == generation
