"""The `quantization="int8"` engine option (specialists/quantize.py): weight-only int8 products with bf16
activations on the CPU, and the row-canonical attention that keeps speculation exact with them.

* an int8 product's row does not depend on the other rows of the call (1 row against 2..8, bit for bit);
* every product weight of a Llama is quantized, a hybrid is refused by name, an unknown mode is refused;
* row-canonical attention (each row alone, as its decode) agrees with the batched attention to fp32
  rounding, for a prefill, a verify and a mixed batch;
* greedy speculative output equals plain output with int8 products, one request at a time and six at
  once, and six at once equal one at a time (shell; the general specialist is measured by bench.decode).
"""

from __future__ import annotations

import pytest
import torch

from policies.policy import SpeculationPolicy
from specialists.chat import render
from specialists.engine import Engine
from specialists.ops.linear import _Int8Linear
from specialists.options import EngineOptions, OptionsError
from specialists.quantize import product_weights
from specialists.sampling import SamplingParams

QUESTIONS = ["list files sorted by size", "How do I find large files?", "count lines in a file", "show disk usage",
             "compress a directory", "rename all .txt files"]


@pytest.mark.parametrize("shape", [(960, 576), (3072, 576), (576, 1536), (4096, 256)])
def test_int8_product_rows_do_not_depend_on_the_other_rows(shape) -> None:
    g = torch.Generator().manual_seed(0)
    q = _Int8Linear(torch.randn(*shape, generator=g) * 0.05)
    for m in range(2, 9):
        x = torch.randn(m, shape[1], generator=g) * 3
        full = q(x)
        for i in range(m):
            assert torch.equal(full[i:i + 1], q(x[i:i + 1])), (shape, m, i)


def test_int8_quantizes_every_product_and_refuses_hybrids() -> None:
    eng = Engine.from_pretrained("deploy/models/shell", policy=SpeculationPolicy(mode="off"), quantization="int8")
    model = eng.runner.model
    assert eng.quantized == len(product_weights(model)) == 1 + 4 * len(model.layers)  # lm_head; qkv, o, gate_up, down
    assert eng.runner.row_exact
    with pytest.raises(ValueError, match="attention-only"):
        Engine.from_pretrained("deploy/models/cpp", policy=SpeculationPolicy(mode="off"), quantization="int8")
    with pytest.raises(ValueError, match="attention-only"):
        Engine.from_pretrained("deploy/models/cpp", policy=SpeculationPolicy(mode="off"), quantization="q4")
    with pytest.raises(OptionsError, match="quantization"):
        EngineOptions(quantization="q3").resolve()


def test_row_canonical_attention_agrees_with_batched_attention() -> None:
    """The same engine with and without row_exact (fp32 products): logits of a prefill, verify-sized
    and mixed steps agree to fp32 rounding, so the canonical path computes the same attention."""
    prompts = [render([{"role": "user", "content": q}], None, True) for q in QUESTIONS[:3]]
    outs = {}
    for exact in (False, True):
        eng = Engine.from_pretrained("deploy/models/shell", policy=SpeculationPolicy(mode="on", num_speculative_tokens=3))
        eng.runner.row_exact = exact
        logits = []
        original = eng.runner.model.logits
        eng.runner.model.logits = lambda h, f=original: logits.append(f(h)) or logits[-1]
        eng.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        outs[exact] = logits
    assert len(outs[True]) == len(outs[False]) > 0
    for a, b in zip(outs[False], outs[True]):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_int8_speculation_equals_plain_at_any_batch() -> None:
    prompts = [render([{"role": "user", "content": q}], None, True) for q in QUESTIONS]
    params = SamplingParams(max_tokens=96, ignore_eos=True)
    alone, together = {}, {}
    for mode in ("off", "on"):
        eng = Engine.from_pretrained("deploy/models/shell", policy=SpeculationPolicy(mode=mode, num_speculative_tokens=3),
                                     quantization="int8")
        alone[mode] = [eng.generate([p], params)[0].token_ids for p in prompts]
        together[mode] = [o.token_ids for o in eng.generate(prompts, params)]
        if mode == "on":
            assert eng.metrics()["accepted"] > 0
    assert alone["on"] == alone["off"]
    assert together["on"] == together["off"] == alone["off"]
