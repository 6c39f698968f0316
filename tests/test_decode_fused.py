"""The target's fused decode path on CUDA (specialists/ops/decode_fused.py): RMSNorm, SiLU * up and
the in-place residual product against the torch ops they replace. On CPU through Triton's interpreter
in fp32; with CANTATA_TEST_DEVICE=cuda compiled, in bf16, and the engines on random bf16 weights (a
Llama and a Bamba hybrid) give speculative output equal to plain output on this path, and tokens
close to the torch path's."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
DEV = os.environ.get("CANTATA_TEST_DEVICE", "cpu")
CUDA = DEV.startswith("cuda")
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1", allow_module_level=True)

from specialists.ops import decode_fused as D  # noqa: E402

DT = torch.bfloat16 if CUDA else torch.float32
TOL = 2e-2 if CUDA else 2e-5  # bf16: a last-bit difference of a product of ~1


def _operands(n: int, k: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(DT)
    return g, w


def test_only_small_half_steps_on_cuda_use_them() -> None:
    assert not D.enabled(torch.zeros(1, 8))  # CPU fp32
    if CUDA:
        assert D.enabled(torch.zeros(4, 8, device=DEV, dtype=torch.bfloat16))
        assert not D.enabled(torch.zeros(D.MAX_ROWS + 1, 8, device=DEV, dtype=torch.bfloat16))
        assert not D.enabled(torch.zeros(4, 8, device=DEV))  # fp32 keeps the torch path


@pytest.mark.skipif(not CUDA, reason="the engines' fused path runs on CUDA in half precision")
@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-bamba"])
def test_engines_with_fused_products(shape: str, tmp_path, monkeypatch) -> None:
    from bench.shapes import build_checkpoint
    from policies.policy import SpeculationPolicy
    from specialists.engine import Engine
    from specialists.sampling import SamplingParams

    ckpt = build_checkpoint(shape, tmp_path / shape, torch.bfloat16, "cuda", drafter_k=3)
    kw = dict(device="cuda", dtype=torch.bfloat16, max_num_seqs=4)
    prompts = [list(range(11, 11 + n)) for n in (5, 33, 70)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = [o.token_ids for o in Engine.from_pretrained(ckpt, policy=SpeculationPolicy(mode="off"), **kw).generate(prompts, params)]
    spec = Engine.from_pretrained(ckpt, policy=SpeculationPolicy(mode="on", num_speculative_tokens=3), **kw)
    assert [o.token_ids for o in spec.generate(prompts, params)] == plain
    monkeypatch.setenv("CANTATA_FUSED_DECODE", "0")
    torch_path = [o.token_ids for o in Engine.from_pretrained(ckpt, policy=SpeculationPolicy(mode="off"), **kw).generate(prompts, params)]
    same = sum(a == b for a, b in zip(plain, torch_path))
    agree = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(plain, torch_path))
    assert agree >= 0.5 * sum(map(len, plain)), (same, agree)  # bf16 rounding may part ways late, not at once


@pytest.mark.parametrize("m", [1, 7])
def test_norm_silu_and_residual_product_match_torch(m: int) -> None:
    g, w = _operands(48, 160, 20 + m)
    h = torch.randn(m, 48, device=DEV, generator=g).to(DT)
    gain = (torch.rand(48, device=DEV, generator=g) + 0.5).to(DT)
    torch.testing.assert_close(D.rms_norm(h, gain, 1e-6).float(), F.rms_norm(h, (48,), gain, 1e-6).float(), atol=TOL, rtol=TOL)
    gu = torch.randn(m, 320, device=DEV, generator=g).to(DT)
    gate, up = gu.chunk(2, dim=-1)
    a = D.silu_mul(gu)  # the same two roundings as torch's two kernels
    torch.testing.assert_close(a.float(), (F.silu(gate) * up).float(), atol=TOL, rtol=TOL)
    ref = h + F.linear(a, w)
    out = h.clone()
    assert D.add_product(out, a, w) is out
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("m", [1, 3])
def test_gemv_with_its_neighbours_matches_torch(m: int) -> None:
    g, w = _operands(40, 200, 30 + m)  # K not a multiple of the block: masked tails
    x = torch.randn(m, 200, device=DEV, generator=g).to(DT)
    gain = (torch.rand(200, device=DEV, generator=g) + 0.5).to(DT)
    torch.testing.assert_close(D.gemv(x, w).float(), F.linear(x, w).float(), atol=TOL, rtol=TOL)
    ref = F.linear(F.rms_norm(x, (200,), gain, 1e-5), w)
    torch.testing.assert_close(D.gemv(x, w, gain=gain, eps=1e-5).float(), ref.float(), atol=TOL, rtol=TOL)
    gu = torch.randn(m, 400, device=DEV, generator=g).to(DT)
    h = torch.randn(m, 40, device=DEV, generator=g).to(DT)
    ref = h + F.linear(F.silu(gu[:, :200]) * gu[:, 200:], w)
    out = h.clone()
    assert D.gemv(gu, w, swiglu=True, residual=out) is out
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL, rtol=TOL)


def test_gemv_rows_do_not_depend_on_the_call() -> None:
    g, w = _operands(24, 96, 5)
    x = torch.randn(7, 96, device=DEV, generator=g).to(DT)
    gain = torch.ones(96, device=DEV, dtype=DT)
    together = D.gemv(x, w, gain=gain, eps=1e-6, config=(8, 32, 4))  # two launches: rows 0-3, 4-6
    for i in range(7):  # each row alone sits in slot 0
        assert torch.equal(D.gemv(x[i:i + 1], w, gain=gain, eps=1e-6, config=(8, 32, 4)), together[i:i + 1])
    assert torch.equal(D.gemv(x[2:6], w, gain=gain, eps=1e-6, config=(8, 32, 4)), together[2:6])
    with pytest.raises(ValueError, match="at most"):
        D.gemv(torch.zeros(D.GEMV_ROWS + 1, 96, device=DEV, dtype=DT), w)
    with pytest.raises(ValueError, match="row-major"):
        D.gemv(x[:, :50], w)


@pytest.mark.skipif(CUDA, reason="the CPU run of the bench script (on a GPU it times)")
def test_fused_products_bench_runs_and_agrees(tmp_path, capsys) -> None:
    import json

    from bench import fused_products

    out = tmp_path / "rows.jsonl"
    fused_products.main(["--shapes", "tiny-llama", "--rows", "1", "3", "--device", "cpu", "--results", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["piece"] for r in rows} == {"norm", "silu_mul", "o", "down", "qkv_gemv", "gate_up_gemv", "o_gemv", "down_gemv"}
    assert {r["rows"] for r in rows} == {1, 3} and len(rows) == 16
    assert all(r["max_abs_diff"] < 1e-4 for r in rows), [(r["piece"], r["max_abs_diff"]) for r in rows]
    assert all(r["weight_mb"] > 0 for r in rows if r["piece"] not in ("norm", "silu_mul"))
