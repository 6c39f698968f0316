"""Cantata's native CPU kernels (specialists/ops/native.py, native/cantata_cpu.c) and the int8 Llama
forward built on them (specialists/models/llama_native.py).

* where the CPU has AVX-512 VNNI and a C compiler runs, the library builds and loads;
* a product equals the integer reference (activations rounded per row to int16, exact int64 sums, one
  rounding, the two scales) bit for bit, and a row's result does not depend on the rows beside it;
* the native forward agrees with the torch forward over the same int8 weights, and a step's rows are
  the same bit for bit whether they run alone or in a verify / a mixed batch (speculation's exactness);
* with CANTATA_NATIVE=0 the engine takes torch's int8 path and says why the native one is off.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from policies.policy import SpeculationPolicy
from specialists.engine import Engine
from specialists.models.batch import ForwardBatch, SeqStep
from specialists.ops import native
from specialists.ops.linear import _Int8Linear

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")


def test_the_library_builds_where_the_cpu_can_run_it() -> None:
    if native._cpu_ok() is None:  # this CPU has the instructions: a missing build is a failure, not a skip
        assert native.available(), native.why_unavailable()
    else:
        assert not native.available() and native.why_unavailable()


def _reference(x: torch.Tensor, q: _Int8Linear) -> torch.Tensor:
    """What cantata_qlinear computes, in torch: per-row int16 with |q| <= 8191, exact sums, fp32 scales."""
    amax = x.abs().amax(dim=1)
    inv = torch.tensor(8191.0) / amax
    xq = torch.round(x * inv[:, None]).to(torch.int64)
    acc = xq @ q.w.to(torch.int64).T
    return acc.to(torch.float32) * (amax / 8191.0)[:, None] * q.scale32[None, :]


@needs_native
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (100, 70), (33, 2100)])
def test_product_equals_the_integer_reference_and_rows_are_independent(shape) -> None:
    g = torch.Generator().manual_seed(1)
    q = _Int8Linear(torch.randn(*shape, generator=g) * 0.05, native=True)
    x = torch.randn(9, shape[1], generator=g) * 3
    full = native.qlinear(x, q.w, q.scale32)
    assert torch.equal(full, _reference(x, q))
    for m in range(1, 9):  # 1..8 rows: the four-row and the one-row kernels
        part = native.qlinear(x[:m], q.w, q.scale32)
        assert torch.equal(part, full[:m]), (shape, m)
    assert torch.equal(native.qlinear(x[5:6], q.w, q.scale32), full[5:6])
    zero = native.qlinear(torch.zeros(2, shape[1]), q.w, q.scale32)  # an all-zero row: scale 0, no NaN
    assert torch.equal(zero, torch.zeros_like(zero))


def _engine() -> Engine:
    return Engine.from_pretrained("deploy/models/shell", policy=SpeculationPolicy(mode="off"), quantization="int8")


def _run(model, kv, steps: list[SeqStep]) -> torch.Tensor:
    return model(ForwardBatch.build(steps, kv.block_size), kv)


@needs_native
def test_native_forward_agrees_with_torch_and_rows_are_exact_in_any_step() -> None:
    eng = _engine()
    model, kv = eng.runner.model, eng.kv
    assert model.native is not None
    bs = kv.block_size
    ids = list(range(40, 40 + 3 * bs + 5))
    table = [7, 2, 9, 4, 11]  # scattered blocks: the walk through the table, not a contiguous run
    other = [13, 14, 15, 16, 17]
    prefill = SeqStep(0, ids[:-4], 0, table, True, "all")
    h_native = _run(model, kv, [prefill])
    plan, model.native = model.native, None
    try:
        h_torch = _run(model, kv, [prefill])
    finally:
        model.native = plan
    torch.testing.assert_close(h_native, h_torch, rtol=2e-2, atol=2e-2)
    agree = (model.logits(h_native).argmax(-1) == model.logits(h_torch).argmax(-1)).float().mean()
    assert agree >= 0.9, float(agree)

    _run(model, kv, [prefill])  # the native pool again
    n = len(ids) - 4
    verify = _run(model, kv, [SeqStep(0, ids[n:], n, table, False, "all")])  # 4 rows at once
    alone = [_run(model, kv, [SeqStep(0, [ids[n + i]], n + i, table, False, "all")]) for i in range(4)]
    assert torch.equal(verify, torch.cat(alone))
    # in a batch beside another sequence (its own prefill), the same rows again
    mixed = _run(model, kv, [SeqStep(1, ids[:9], 0, other, True, "all"), SeqStep(0, ids[n:], n, table, False, "all")])
    assert torch.equal(mixed[9:], verify)


def test_auto_quantizes_real_checkpoints_on_this_cpu_and_keeps_the_toys_exact() -> None:
    """quantization="auto" (the default): the 3.5M-parameter toys stay fp32 (the exactness test bed;
    their fp32 stack runs natively), the general specialist (135M) gets its GGUF's 4-bit blocks (q4)
    where the native kernels run, and with "none" keeps torch's fp32 path (oneDNN verifies faster than our fp32 kernel there)."""
    toy = Engine.from_pretrained("deploy/models/shell", policy=SpeculationPolicy(mode="off"))
    assert toy.cfg.quantization == "none" and toy.quantized == 0
    assert (toy.runner.model.native is not None and toy.runner.model.native.fp32) == native.available()
    general = Engine.from_pretrained("deploy/models/general", policy=SpeculationPolicy(mode="off"))
    want = "q4" if native.available() else "none"  # its import keeps the GGUF's blocks
    assert general.cfg.quantization == want and (general.quantized > 0) == (want == "q4")
    assert (general.runner.model.native is not None) == (want == "q4") and general.runner.row_exact == (want == "q4")
    fp32 = Engine.from_pretrained("deploy/models/general", policy=SpeculationPolicy(mode="off"), quantization="none")
    assert fp32.cfg.quantization == "none" and fp32.quantized == 0 and fp32.runner.model.native is None


@needs_native
def test_native_fp32_forward_agrees_with_torch_and_transformers() -> None:
    """A toy's fp32 stack through the native kernels: hidden states within fp32 rounding of the torch
    path, the same greedy logits argmax as transformers' LlamaForCausalLM on every row, and a verify's
    rows bit for bit the decodes'."""
    from transformers import AutoModelForCausalLM

    eng = Engine.from_pretrained("deploy/models/shell", policy=SpeculationPolicy(mode="off"))
    model, kv = eng.runner.model, eng.kv
    assert model.native is not None and model.native.fp32
    ids = eng.tokenizer("tar -czf backup.tar.gz /home/user/docs && ls -la | grep backup | wc -l")["input_ids"]
    table = [6, 1, 9, 3]
    h_native = _run(model, kv, [SeqStep(0, ids, 0, table, True, "all")])
    plan, model.native = model.native, None
    try:
        h_torch = _run(model, kv, [SeqStep(0, ids, 0, table, True, "all")])
    finally:
        model.native = plan
    torch.testing.assert_close(h_native, h_torch, rtol=1e-4, atol=1e-4)
    hf = AutoModelForCausalLM.from_pretrained("deploy/models/shell", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert torch.equal(model.logits(h_native).argmax(-1), ref.argmax(-1))
    n = len(ids) - 4
    _run(model, kv, [SeqStep(0, ids[:n], 0, table, True, "all")])
    verify = _run(model, kv, [SeqStep(0, ids[n:], n, table, False, "all")])
    alone = [_run(model, kv, [SeqStep(0, [ids[n + i]], n + i, table, False, "all")]) for i in range(4)]
    assert torch.equal(verify, torch.cat(alone))


def test_native_off_falls_back_to_torch_int8() -> None:
    code = ("from specialists.ops import native; from specialists.engine import Engine; "
            "from policies.policy import SpeculationPolicy; from specialists.sampling import SamplingParams; "
            "assert not native.available() and native.why_unavailable() == 'CANTATA_NATIVE=0'; "
            "e = Engine.from_pretrained('deploy/models/shell', policy=SpeculationPolicy(mode='off'), quantization='int8'); "
            "assert e.runner.model.native is None; "
            "print(len(e.generate(['ls -la'], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids))")
    env = dict(os.environ, CANTATA_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "5"


@needs_native
def test_native_drafter_rebuilds_and_drafts_like_the_torch_path() -> None:
    """The drafter's native rebuild and chain (drafter_native.py) against its torch path on the same
    target hidden states (both read the same int8 products): entry outputs within 1e-3, drafts the
    same (>= 95%)."""
    eng = Engine.from_pretrained("deploy/models/shell", policy=SpeculationPolicy(mode="on", num_speculative_tokens=3))
    model, kv, drafter = eng.runner.model, eng.kv, eng.drafter
    assert drafter.native is not None
    ids = eng.tokenizer("find . -name '*.py' -exec grep -n TODO {} + | sort | uniq -c | head -20")["input_ids"]
    table = [3, 8, 5]
    batch = ForwardBatch.build([SeqStep(0, ids, 0, table, True, "all")], kv.block_size)
    hidden = model(batch, kv)
    nxt = torch.tensor(ids[1:] + [ids[0]])
    tables = torch.tensor([table] * (len(ids) - 1), dtype=torch.int32)
    committed = list(range(1, len(ids)))  # row i drafts from entry i (entries [0, i] in the pool)
    outs, drafts = {}, {}
    for name in ("native", "torch"):
        plan = drafter.native
        if name == "torch":
            drafter.native = None
        try:
            outs[name] = drafter.rebuild(batch, hidden, nxt)
            drafts[name], counts = drafter.chain(outs[name][:-1], committed, tables, 3)
        finally:
            drafter.native = plan
        assert drafts[name].shape == (len(ids) - 1, 3) and counts == [3] * (len(ids) - 1)
    rel = (outs["native"] - outs["torch"]).norm() / outs["torch"].norm()
    assert rel < 1e-3, float(rel)
    same = (drafts["native"] == drafts["torch"]).float().mean()
    assert same >= 0.95, float(same)


@needs_native
def test_native_guided_chain_drafts_under_the_mask_like_the_torch_path() -> None:
    """A chain under a grammar runs natively (the kernel calls back to the host before each depth for
    the masks): constrained speculative output equals plain constrained output, and it drafts what the
    torch chain drafts under the same masks (the same drafts, kept and changed by the mask, counted)."""
    from specialists.chat import render
    from specialists.sampling import SamplingParams
    from specialists.wire import GrammarSpec

    schema = {"type": "object", "properties": {"command": {"type": "string"}, "count": {"type": "integer"}},
              "required": ["command", "count"]}
    prompts = [render([{"role": "user", "content": q}], None, True) for q in ("list files by size", "show disk usage")]
    results, guided = {}, []
    for name in ("native", "torch", "plain"):
        eng = Engine.from_pretrained("deploy/models/shell", policy=SpeculationPolicy(mode="off" if name == "plain" else "on",
                                                                                    num_speculative_tokens=3))
        if name == "torch":
            eng.drafter.native = None
        elif name == "native":
            chain = eng.drafter.native.chain
            eng.drafter.native.chain = lambda *a, **kw: (guided.append(a[4] is not None), chain(*a, **kw))[1]
        outs = eng.generate(prompts, SamplingParams(max_tokens=80, grammar=eng.grammar(GrammarSpec(kind="json_schema", schema=schema))))
        m = eng.metrics()
        results[name] = ([o.token_ids for o in outs], [m[k] for k in ("drafted", "accepted", "grammar_drafts", "grammar_masked_drafts")])
    assert guided and all(guided)
    assert results["native"][0] == results["torch"][0] == results["plain"][0]
    assert results["native"][1] == results["torch"][1] and results["native"][1][2] > 0


def test_a_failing_compiler_leaves_the_torch_path_and_says_why(tmp_path) -> None:
    code = ("import torch; from specialists.ops import native; "
            "assert not native.available(); print(native.why_unavailable())")
    env = dict(os.environ, CC="/bin/false", CANTATA_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    why = out.stdout.strip()
    assert ("/bin/false failed on cantata_cpu.c" in why) or ("the CPU lacks" in why), why
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built left in the cache
