"""The half-precision CUDA paths of the target (Triton RoPE + KV write, paged attention straight from
the pool, fused RMSNorm; CUDA graphs with multi-step decodes) against transformers on the same bf16
weights: every greedy token the engine emits is transformers' argmax wherever transformers' top-2
margin leaves no doubt (> 0.25 of a logit; below that, bf16 rounding may pick either), and speculative
output equals plain output. Needs a CUDA device (CANTATA_TEST_DEVICE=cuda)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not os.environ.get("CANTATA_TEST_DEVICE", "cpu").startswith("cuda"):
    pytest.skip("the half-precision CUDA paths need CANTATA_TEST_DEVICE=cuda", allow_module_level=True)

from bench.shapes import build_checkpoint  # noqa: E402
from policies.policy import SpeculationPolicy  # noqa: E402
from specialists.engine import Engine  # noqa: E402
from specialists.sampling import SamplingParams  # noqa: E402

MARGIN = 0.25


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("tiny-llama", tmp_path_factory.mktemp("tiny-llama"), torch.bfloat16, "cuda", drafter_k=3)


def test_engine_tokens_are_transformers_argmax_where_clear(checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16).to("cuda").eval()
    engine = Engine.from_pretrained(checkpoint, device="cuda", dtype=torch.bfloat16, max_num_seqs=4,
                                    policy=SpeculationPolicy(mode="off"))
    prompts = [list(range(7, 7 + n)) for n in (9, 40, 130)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    checked = 0
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p + o.token_ids], device="cuda")
        with torch.no_grad():
            logits = hf(ids).logits[0, len(p) - 1:-1].float()  # [24, V]: the logits each emitted token came from
        top2 = logits.topk(2, dim=-1)
        clear = (top2.values[:, 0] - top2.values[:, 1]) > MARGIN
        got = torch.tensor(o.token_ids, device="cuda")
        assert torch.equal(got[clear], top2.indices[clear, 0])
        checked += int(clear.sum())
    assert checked >= 30  # most positions are clear on these weights


def test_speculative_equals_plain_in_bf16(checkpoint: Path) -> None:
    kw = dict(device="cuda", dtype=torch.bfloat16, max_num_seqs=4)
    plain = Engine.from_pretrained(checkpoint, policy=SpeculationPolicy(mode="off"), **kw)
    spec = Engine.from_pretrained(checkpoint, policy=SpeculationPolicy(mode="on", num_speculative_tokens=3), **kw)
    prompts = [list(range(11, 11 + n)) for n in (5, 33, 70)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain.generate(prompts, params)]


def test_prefill_attention_plans_nothing_per_length(checkpoint: Path) -> None:
    """The torch attention path (prefills) never takes cuDNN's SDPA backend, which builds a plan on the
    host for each new shape (~1.7 ms a layer: every prompt length is new); its results, with a bool
    mask or a one-sequence prefill's lower-right causal bias, equal the math backend's to bf16 rounding."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from specialists.ops.attention import sdpa

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 9, n, 64, device="cuda", dtype=torch.bfloat16, generator=g) for n in (37, 53, 53))
    k, v = k[:, :3], v[:, :3]
    mask = torch.ones(37, 53, dtype=torch.bool, device="cuda").tril(53 - 37)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
        torch.cuda.synchronize()
    assert not [e.name for e in prof.events() if "cudnn" in e.name.lower()]
    with sdpa_kernel([SDPBackend.MATH]):
        want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                                enable_gqa=True)
    assert (out.float() - want).abs().max() < 3e-2
    from torch.nn.attention.bias import causal_lower_right  # what a one-sequence prefill passes

    lower_right = sdpa(q, k, v, attn_mask=causal_lower_right(37, 53), enable_gqa=True)
    assert (lower_right.float() - want).abs().max() < 3e-2
    engine = Engine.from_pretrained(checkpoint, device="cuda", dtype=torch.bfloat16, policy=SpeculationPolicy(mode="off"))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate([list(range(5, 5 + 77))], SamplingParams(max_tokens=2, ignore_eos=True))
    assert not [e.name for e in prof.events() if "cudnn" in e.name.lower()]
