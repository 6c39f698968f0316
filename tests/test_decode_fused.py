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
@pytest.mark.parametrize("shape,fold", [("tiny-llama", None), ("tiny-bamba", None), ("tiny-llama", "1"), ("tiny-bamba", "1")])
def test_engines_with_fused_products(shape: str, fold: str | None, tmp_path, monkeypatch) -> None:
    """fold "1": the norms' gains folded into q/k/v and gate/up at the tiny models' widths too (the
    default folds from d 2048: llama.folds_norm_gains)."""
    from bench.shapes import build_checkpoint
    from policies.policy import SpeculationPolicy
    from specialists.engine import Engine
    from specialists.sampling import SamplingParams

    if fold:
        monkeypatch.setenv("CANTATA_FOLD_NORM", fold)

    ckpt = build_checkpoint(shape, tmp_path / shape, torch.bfloat16, "cuda", drafter_k=3)
    kw = dict(device="cuda", dtype=torch.bfloat16, max_num_seqs=4)
    prompts = [list(range(11, 11 + n)) for n in (5, 33, 70)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = [o.token_ids for o in Engine.from_pretrained(ckpt, policy=SpeculationPolicy(mode="off"), **kw).generate(prompts, params)]
    spec = Engine.from_pretrained(ckpt, policy=SpeculationPolicy(mode="on", num_speculative_tokens=3), **kw)
    layers = spec.runner.model.layers
    assert all(layer.mlp.folded == bool(fold) for layer in layers)
    assert all((layer.mamba.folded_norm_eps is not None) == bool(fold) for layer in layers if getattr(layer, "mamba", None))
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


@pytest.mark.parametrize("m,config", [(1, None), (5, (16, 64, 4, 2, 3)), (20, (32, 32, 4, 3, 2))])
def test_mma_with_its_neighbours_matches_torch(m: int, config) -> None:
    g, w = _operands(40, 200, 40 + m)  # K not a multiple of the block nor of the split: masked tails
    x = torch.randn(m, 200, device=DEV, generator=g).to(DT)
    gain = (torch.rand(200, device=DEV, generator=g) + 0.5).to(DT)
    bias = torch.randn(40, device=DEV, generator=g).to(DT)
    torch.testing.assert_close(D.mma(x, w, config=config).float(), F.linear(x, w).float(), atol=TOL, rtol=TOL)
    ref = F.linear(F.rms_norm(x, (200,), gain, 1e-5), w, bias)
    torch.testing.assert_close(D.mma(x, w, bias, gain=gain, eps=1e-5, config=config).float(), ref.float(), atol=TOL, rtol=TOL)
    h = torch.randn(m, 40, device=DEV, generator=g).to(DT)  # under the norm with a residual (a Mamba layer's out_proj)
    out = h.clone()
    assert D.mma(x.float(), w, gain=gain, eps=1e-5, residual=out, config=config) is out  # fp32 x (the gated output)
    torch.testing.assert_close(out.float(), (h + F.linear(F.rms_norm(x, (200,), gain, 1e-5), w)).float(), atol=TOL, rtol=TOL)
    gu = torch.randn(m, 400, device=DEV, generator=g).to(DT)
    h = torch.randn(m, 40, device=DEV, generator=g).to(DT)
    ref = h + F.linear(F.silu(gu[:, :200]) * gu[:, 200:], w)
    out = h.clone()
    assert D.mma(gu, w, swiglu=True, residual=out, config=config) is out
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("m,bias", [(1, False), (6, True)])
def test_glu_end_is_the_swiglu_of_the_product(m: int, bias: bool) -> None:
    """mma(glu=True) over w = [gate | up] stores silu(gate) * up with the roundings of the product then
    silu_mul: the same bits (the gate and up rows' tiles are the products' tiles); a row alone alike."""
    g, w = _operands(2 * 96, 160, 60 + m)
    x = torch.randn(m, 160, device=DEV, generator=g).to(DT)
    gain = (torch.rand(160, device=DEV, generator=g) + 0.5).to(DT)
    b = torch.randn(2 * 96, device=DEV, generator=g).to(DT) if bias else None
    config = (32, 64, 4, 2, 1)
    ref = D.silu_mul(D.mma(x, w, b, gain=gain, eps=1e-5, config=config))
    got = D.mma(x, w, b, gain=gain, eps=1e-5, glu=True, config=config)
    assert got.shape == (m, 96) and torch.equal(got, ref)
    assert torch.equal(D.mma(x[-1:], w, b, gain=gain, eps=1e-5, glu=True, config=config), got[-1:])
    with pytest.raises(ValueError, match="glu"):
        D.mma(x, w, glu=True, config=(32, 64, 4, 2, 2))


@pytest.mark.parametrize("split", [1, 2, 3])
def test_a_gain_folded_into_the_weight_is_the_norm(split: int) -> None:
    """mma(folded=True) over W * gain: rms_norm(x) * gain @ W^T, the sum of squares from the streamed
    tiles (split over K: their partials summed in order)."""
    g, w = _operands(40, 200, 70 + split)
    x = torch.randn(5, 200, device=DEV, generator=g).to(DT)
    gain = (torch.rand(200, device=DEV, generator=g) + 0.5).to(DT)
    folded = (w.float() * gain.float()).to(DT)
    ref = F.linear(F.rms_norm(x, (200,), gain, 1e-5), w)
    got = D.mma(x, folded, folded=True, eps=1e-5, config=(16, 32, 4, 2, split))
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL, rtol=TOL)
    gu = torch.cat([folded, (torch.randn(40, 200, device=DEV, generator=g) / 15).to(DT)])
    both = D.mma(x, gu, folded=True, eps=1e-5, glu=True, config=(16, 32, 4, 2, 1))
    torch.testing.assert_close(both.float(), D.silu_mul(D.mma(x, gu, folded=True, eps=1e-5, config=(16, 32, 4, 2, 1))).float(),
                               atol=TOL, rtol=TOL)


def test_folded_norms_keep_the_torch_path() -> None:
    """llama.fold_norm_gain: q/k/v and gate/up times the gain, the norm's gain ones; the torch path's
    blocks give what they gave before the fold (prefills run them)."""
    from specialists.models.llama import AttentionWeights, MLPWeights, fold_norm_gain, mlp_block, rms_norm
    from specialists.ops.linear import linear

    g, _ = _operands(1, 1, 90)
    mk = lambda *s: (torch.randn(*s, device=DEV, generator=g) / 8).to(DT)  # noqa: E731
    attn = AttentionWeights(mk(64, 32), mk(32, 32), mk(32, 32), mk(32, 64), None, None, None, None, 4, 2, 16)
    mlp = MLPWeights(mk(48, 32), mk(48, 32), mk(32, 48), None, None, None)
    x, gain = torch.randn(7, 32, device=DEV, generator=g).to(DT), (torch.rand(32, device=DEV, generator=g) + 0.5).to(DT)
    qkv_ref = linear(rms_norm(x, gain, 1e-5), attn.qkv)
    mlp_ref = mlp_block(mlp, rms_norm(x, gain, 1e-5))
    ones = fold_norm_gain(attn, gain)
    assert attn.folded and torch.equal(ones, torch.ones_like(gain)) and attn.q_proj.data_ptr() == attn.qkv.data_ptr()
    torch.testing.assert_close(linear(rms_norm(x, ones, 1e-5), attn.qkv), qkv_ref, atol=TOL, rtol=TOL)
    fold_norm_gain(mlp, gain)
    torch.testing.assert_close(mlp_block(mlp, rms_norm(x, ones, 1e-5)), mlp_ref, atol=TOL, rtol=TOL)


def test_a_folded_mamba_in_proj_leaves_the_callers_weight_alone() -> None:
    """bamba._fold_in_proj folds the gain into the layer's own copy: the state dict it was built from
    (shared, not copied, where it already had the model's device and dtype) keeps its values."""
    from types import SimpleNamespace

    from specialists.models.bamba import _fold_in_proj
    from specialists.ops.mamba2 import Mamba2Params

    g, _ = _operands(1, 1, 91)
    h, hd, n, d = 2, 8, 4, 16
    conv_dim = h * hd + 2 * n
    sd = {"in_proj.weight": torch.randn(2 * h * hd + 2 * n + h, d, device=DEV, generator=g).to(DT),
          "conv1d.weight": torch.randn(conv_dim, 1, 4, device=DEV, generator=g).to(DT),
          "dt_bias": torch.zeros(h, device=DEV), "A_log": torch.zeros(h, device=DEV), "D": torch.ones(h, device=DEV),
          "norm.weight": torch.ones(h * hd, device=DEV, dtype=DT), "out_proj.weight": torch.zeros(d, h * hd, device=DEV, dtype=DT)}
    cfg = SimpleNamespace(hidden_act="silu", mamba_n_heads=h, mamba_d_head=hd, mamba_n_groups=1, mamba_d_state=n,
                          mamba_d_conv=4, mamba_chunk_size=8, rms_norm_eps=1e-5,
                          time_step_limit=(0.0, float("inf")))
    p = Mamba2Params.from_state_dict(sd, cfg)
    before = sd["in_proj.weight"].clone()
    gain = (torch.rand(d, device=DEV, generator=g) + 0.5).to(DT)
    ones = _fold_in_proj(p, gain, 1e-5)
    assert torch.equal(sd["in_proj.weight"], before) and torch.equal(ones, torch.ones_like(gain))
    assert p.folded_norm_eps == 1e-5 and torch.equal(p.in_proj_weight, (before.float() * gain.float()).to(DT))


@pytest.mark.parametrize("split,bias", [(1, False), (2, True)])
def test_the_qkv_product_carries_rope_and_the_kv_write(split: int, bias: bool) -> None:
    """mma(rope=...) against the product then ops/rope_kv.py's kernel: the same q, and the same k and v
    in the pool at each row's slot (bit for bit: the same roundings and the same fp32 rotation),
    nothing else of the pool written; a row's q and KV do not depend on the other rows."""
    from specialists.ops.rope_kv import rope_write_kv

    hq, hkv, d, m, k = 4, 2, 32, 5, 96
    g, w = _operands((hq + 2 * hkv) * d, k, 70 + split)
    x = torch.randn(m, k, device=DEV, generator=g).to(DT)
    gain = (torch.rand(k, device=DEV, generator=g) + 0.5).to(DT)
    b = torch.randn(w.shape[0], device=DEV, generator=g).to(DT) if bias else None
    ang = torch.rand(m, d // 2, device=DEV, generator=g) * 6.0
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(DT), torch.cat([ang.sin()] * 2, -1).to(DT)
    slots = torch.tensor([9, 2, 17, 30, 5], device=DEV)
    pools = [torch.zeros(4, 8, hkv, d, device=DEV, dtype=DT) for _ in range(4)]  # (k, v) fused, (k, v) reference
    config = (d, 32, 4, 2, split)
    q = D.mma(x, w, b, gain=gain, eps=1e-5, config=config,
              rope=D.RopeKV(cos, sin, slots, pools[0], pools[1], hq, hkv))
    ref = rope_write_kv(D.mma(x, w, b, gain=gain, eps=1e-5, config=config), cos, sin, pools[2], pools[3], slots, hq, hkv, d)
    assert q.shape == (m, hq, d)
    assert torch.equal(q, ref)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    flat = pools[0].view(-1, hkv, d)
    assert flat[slots].abs().sum() > 0 and flat[[i for i in range(32) if i not in slots.tolist()]].abs().sum() == 0
    one = D.mma(x[3:4], w, b, gain=gain, eps=1e-5, config=config,
                rope=D.RopeKV(cos[3:4], sin[3:4], slots[3:4], torch.zeros_like(pools[0]), torch.zeros_like(pools[1]), hq, hkv))
    assert torch.equal(one[0], q[3])
    with pytest.raises(ValueError, match="RoPE"):
        D.mma(x, w, gain=gain, config=(64, 32, 4, 2, 1), rope=D.RopeKV(cos, sin, slots, pools[0], pools[1], hq, hkv))


@pytest.mark.parametrize("split", [1, 4])
def test_mma_rows_do_not_depend_on_the_call(split: int) -> None:
    """A row's product is the same bits alone, in any slot and among other rows, with K split or not,
    and again on a second call (the split's counters reset). Across tiles of 16, 32 and 64 rows the
    tensor cores give the same bits too (CUDA); the interpreter's numpy products only agree closely."""
    g, w = _operands(48, 256, 6)
    x = torch.randn(40, 256, device=DEV, generator=g).to(DT)
    gain = (torch.rand(256, device=DEV, generator=g) + 0.5).to(DT)
    config = (16, 32, 4, 2, split)

    def prod(rows):
        return D.mma(x[rows], w, gain=gain, eps=1e-6, config=config)

    tile16, together = prod(slice(0, 16)), prod(slice(0, 40))  # tiles of 16 and 64 rows
    for i in (0, 3, 15):  # alone (slot 0) against its slot among 16
        assert torch.equal(prod(slice(i, i + 1)), tile16[i:i + 1])
    assert torch.equal(prod(slice(2, 6)), tile16[2:6]) and torch.equal(prod(slice(0, 40)), together)
    for rows in (slice(0, 16), slice(5, 30), slice(39, 40)):
        if CUDA:
            assert torch.equal(prod(rows), together[rows])
        else:
            torch.testing.assert_close(prod(rows), together[rows], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="at most"):
        D.mma(torch.zeros(D.MAX_ROWS + 1, 256, device=DEV, dtype=DT), w)
    with pytest.raises(ValueError, match="row-major"):
        D.mma(x[:, :50], w)
    with pytest.raises(ValueError, match="arrival counters"):  # the counters' buffer is never replaced
        huge = torch.zeros(1, 256, device=DEV, dtype=DT).expand(16 * D.LOCK_SLOTS + 16, 256)  # no memory
        D.mma(x[:1], huge, config=(16, 32, 4, 2, 2))


def test_mma_config_depends_on_the_weight_alone() -> None:
    assert D.mma_config(2, 2048, 8192) == (64, 128, 8, 3, 8)  # measured (llama-1b's down)
    bn, bk, _, _, split = D.mma_config(0, 4096, 4096)  # the rule: ~256 programs, >= 256 columns a split
    assert (bn, bk, split) == (64, 128, 4) and D.mma_config(2, 4096, 512)[4] == 2  # 64 blocks x 4; 2 x 256
    assert D.mma_config(1, 4096, 4096)[4] == 1 and D.mma_config(0, 512, 16384)[4] == 8  # no split under RMSNorm
    assert D.mma_config(3, 960, 576) == D.mma_config(1, 960, 576)  # a folded norm: the norm's entry (smollm2's q/k/v)
    assert D.mma_config(0, 576, 1536) == D.mma_config(2, 576, 1536)  # a plain down: the SiLU prologue's entry
    assert D.mma_config(4, 1536, 576)[0] == 32 and D.mma_config(4, 8192, 4096)[0] == 64  # SwiGLU end: >= 48 programs


@pytest.mark.skipif(CUDA, reason="the CPU run of the bench script (on a GPU it times)")
def test_fused_products_bench_runs_and_agrees(tmp_path, capsys) -> None:
    import json

    from bench import fused_products

    out = tmp_path / "rows.jsonl"
    fused_products.main(["--shapes", "tiny-llama", "--rows", "1", "3", "--device", "cpu", "--results", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["piece"] for r in rows} == {"norm", "silu_mul", "o", "down", "qkv_mma", "gate_up_mma", "o_mma", "down_mma",
                                          "lm_head_mma", "qkv_folded_mma", "gate_up_glu_mma", "down_plain_mma"}
    assert {r["rows"] for r in rows} == {1, 3} and len(rows) == 24
    fused_products.main(["--shapes", "tiny-bamba", "--rows", "2", "--device", "cpu", "--results", str(out),
                         "--pieces", "in_proj_mma", "out_proj_mma", "in_proj_norm_mma"])  # a hybrid's Mamba products
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["shape"], r["piece"]) for r in rows[24:]] == [("tiny-bamba", p) for p in ("in_proj_mma", "in_proj_norm_mma", "out_proj_mma")]
    assert all(r["max_abs_diff"] < 1e-4 for r in rows), [(r["piece"], r["max_abs_diff"]) for r in rows]
    assert all(r["weight_mb"] > 0 for r in rows if r["piece"] not in ("norm", "silu_mul"))


@pytest.mark.skipif(not CUDA, reason="programmatic dependent launch is a CUDA launch option")
def test_small_products_launched_early_keep_the_stream_order(monkeypatch) -> None:
    """On Hopper a product of a small weight launches while the kernel before it runs and waits for it
    (decode_fused.pdl): a chain of products that each read the last one's output gives the bits it
    gives with plain launches, eagerly and replayed in a CUDA graph."""
    g, w1 = _operands(1024, 1024, 8)  # 2 MiB each: under PDL_BYTES
    w2 = (torch.randn(1024, 1024, device=DEV, generator=g) / 32).to(DT)
    x = torch.randn(1, 1024, device=DEV, generator=g).to(DT)
    gain = (torch.rand(1024, device=DEV, generator=g) + 0.5).to(DT)
    if not D.pdl(x.device):
        pytest.skip("programmatic dependent launch needs a Hopper GPU or later")

    def chain(h: torch.Tensor) -> torch.Tensor:
        for _ in range(6):
            D.mma(D.mma(h, w1, gain=gain, eps=1e-6), w2, residual=h)
        return h

    early = chain(x.clone())
    h = x.clone()
    chain(h.clone())  # compiles before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(h)
    graph.replay()
    monkeypatch.setitem(D._PDL, x.device, False)
    plain = chain(x.clone())
    assert torch.equal(early, plain) and torch.equal(h, plain)
    assert not torch.equal(plain, x)
