"""specialists/prefill_graph.py: a fresh prompt's prefill padded to a length of PREFILL_LENGTHS (a CUDA
graph per length on a GPU; on the CPU the same padded forward runs eagerly). Checked against eager
prefills on the same weights: the first token's logits and the greedy tokens after, the KV the prompt
wrote, plain and speculative; steps that are no fresh one-sequence prefill (a prefix hit, a batch of
two prompts, a hybrid) stay eager. With CANTATA_TEST_DEVICE=cuda the graphs run (bf16 too)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from policies.policy import SpeculationPolicy
from specialists.engine import Engine
from specialists.options import EngineOptions, OptionsError
from specialists.prefill_graph import prefill_length
from specialists.runner import BatchRow
from specialists.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DEV = os.environ.get("CANTATA_TEST_DEVICE", "cpu")
CUDA = DEV.startswith("cuda")


def _engine(domain: str, tokens: int, mode: str = "off", dtype: torch.dtype = torch.float32, **kw) -> Engine:
    return Engine.from_pretrained(ROOT / "deploy" / "models" / domain, device=DEV, dtype=dtype, max_num_seqs=4,
                                  num_blocks=256, prefill_graph_tokens=tokens,
                                  policy=SpeculationPolicy(mode=mode, num_speculative_tokens=3), **kw)


def _prompts(n: int, lengths: tuple[int, ...] = (5, 40, 127, 128, 129, 300)) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(10, 2000, (n,), generator=g).tolist() for n in lengths]


def test_prefill_lengths() -> None:
    assert [prefill_length(n, 2048) for n in (1, 128, 129, 2048)] == [128, 128, 256, 2048]
    assert prefill_length(2049, 2048) is None and prefill_length(300, 256) is None  # past the cap: eager
    assert EngineOptions().resolve().prefill_graph_tokens == 0  # the CPU's default: every prefill eager
    with pytest.raises(OptionsError, match="prefill_graph_tokens"):
        EngineOptions(prefill_graph_tokens=-1).resolve()


def _prefill(engine: Engine, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The runner's step for a fresh prompt -> (last logits row, hidden states, the K of every layer it wrote)."""
    kv = engine.kv
    assert kv.add_sequence(999, prompt) == 0
    kv.reserve(999, len(prompt))
    res = engine.runner.run([BatchRow(999, prompt, True, -1)])
    slots = torch.tensor(kv.slot_mapping(999, 0, len(prompt)))
    k = kv.k.view(kv.k.shape[0], -1, *kv.k.shape[3:])[:, slots].float().cpu()
    kv.free(999)
    return res.logits.cpu(), res.hidden.float().cpu(), k


def test_a_padded_prefill_computes_the_eager_prefills_logits_and_kv() -> None:
    """Prompts of 5-300 tokens through the runner: the last logits row, every real token's hidden state
    and the K the prompt wrote equal the eager prefill's to fp32 noise (the padding tokens after the
    prompt change none of them; their K/V went to the scratch block); past the cap the step is eager."""
    padded, eager = _engine("shell", 256), _engine("shell", 0)
    for prompt in _prompts(1):
        a, b = _prefill(padded, prompt), _prefill(eager, prompt)
        for x, y in zip(a, b):
            assert x.shape == y.shape and torch.allclose(x, y, atol=1e-4, rtol=1e-4), (len(prompt), (x - y).abs().max())
    assert padded.stats["padded_prefills"] == 5 and eager.stats["padded_prefills"] == 0  # 300 > 256: eager


@pytest.mark.parametrize("mode", ["off", "on"])
def test_greedy_tokens_after_a_padded_prefill_equal_the_eager_engines(mode: str) -> None:
    """Plain and speculative decoding after padded prefills: the eager engine's greedy tokens; the
    invariants hold after every step."""
    padded, eager = _engine("shell", 256, mode), _engine("shell", 0, mode)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for prompt in _prompts(4, (7, 60, 200)):
        assert padded.generate([prompt], params)[0].token_ids == eager.generate([prompt], params)[0].token_ids
    assert padded.stats["padded_prefills"] == 3
    padded.kv.check_invariants()


def test_steps_that_are_no_fresh_prefill_stay_eager() -> None:
    """A prefix hit (the prompt's blocks cached), two prompts in one step, and a hybrid: not padded."""
    prompts = _prompts(2, (40, 70))
    llama = _engine("shell", 512)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = llama.generate([prompts[0] * 2], params)[0].token_ids
    assert llama.stats["padded_prefills"] == 1
    assert llama.generate([prompts[0] * 2], params)[0].token_ids == first  # a prefix hit: eager over the rest
    assert llama.stats["padded_prefills"] == 1 and llama.stats["prefix_hit_tokens"] > 0
    llama.generate(prompts, params)  # one step of two prefills
    assert llama.stats["padded_prefills"] == 1
    hybrid = _engine("cpp", 512)
    hybrid.generate([prompts[1]], params)
    assert hybrid.stats["padded_prefills"] == 0


@pytest.mark.skipif(not CUDA, reason="CUDA graphs: CANTATA_TEST_DEVICE=cuda")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_graphs_are_captured_once_per_length_and_replayed(dtype: torch.dtype) -> None:
    """On a GPU: the warm-up captures every length up to the cap; a prompt of each length replays its
    graph (no new capture); greedy tokens equal the eager engine's in fp32 and speculation's output
    equals plain decoding's in bf16 (both prefill through the graphs)."""
    padded = _engine("shell", 512, "on", dtype)
    graphs = padded.runner.graphs
    prefills = lambda: [key for key in graphs.keys() if key[0] == "prefill"]  # noqa: E731
    assert padded.runner.capture_prefills() == 3 and prefills() == [("prefill", n) for n in (128, 256, 512)]
    assert padded.runner.capture_prefills() == 0  # captured once
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = _prompts(3, (5, 127, 200, 511))
    spec = [padded.generate([p], params)[0].token_ids for p in prompts]
    assert len(prefills()) == 3 and padded.stats["padded_prefills"] == 4  # replayed: no capture in a request
    padded.set_policy(SpeculationPolicy(mode="off"))
    assert [padded.generate([p], params)[0].token_ids for p in prompts] == spec
    if dtype == torch.float32:
        eager = _engine("shell", 0, "off", dtype)
        assert [eager.generate([p], params)[0].token_ids for p in prompts] == spec
    padded.kv.check_invariants()
