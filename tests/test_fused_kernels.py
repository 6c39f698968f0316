"""The drafter's Triton kernels (specialists/ops/fused.py) against torch: the norm-and-product kernel
with each epilogue, the q/k/v kernel's RoPE and pool writes (by slot and through a block table), and
paged attention with causal limits. On CPU they run through Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1); with CANTATA_TEST_DEVICE=cuda, compiled on the GPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
DEV = os.environ.get("CANTATA_TEST_DEVICE", "cpu")
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1", allow_module_level=True)

from specialists.models.rope import apply_signed_rope, rope_inv_freq, signed_rope_table  # noqa: E402
from specialists.ops import fused  # noqa: E402

H, HKV, HD, BS = 4, 2, 64, 16
TOL = 2e-5


def _unit(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), None, 1e-5)


def _rope_table(n: int) -> torch.Tensor:  # [n, 2, 1, hd]: cos, sin with the rotate-half sign, as the drafter's
    return signed_rope_table(rope_inv_freq(10000.0, HD, DEV), n, torch.float32)


@pytest.mark.parametrize("m", [1, 3, 6])
def test_rows_linear_epilogues(m: int) -> None:
    g = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, 256, device=DEV, generator=g)
    w = torch.randn(300, 256, device=DEV, generator=g) * 0.05
    res = torch.randn(m, 300, device=DEV, generator=g)
    table = torch.randn(50, 300, device=DEV, generator=g)
    tok = torch.randint(0, 50, (m,), device=DEV, generator=g)
    plain = fused.rows_linear(x, w)
    assert (plain - F.linear(x, w)).abs().max() < TOL
    full = fused.rows_linear(x, w, norm_eps=1e-5, residual=res, tokens=tok, table=table)
    assert (full - (F.linear(_unit(x), w) + res + table[tok])).abs().max() < TOL
    w2 = torch.randn(2 * 150, 256, device=DEV, generator=g) * 0.05
    gate, up = F.linear(_unit(x), w2).chunk(2, -1)
    assert (fused.rows_linear(x, w2, norm_eps=1e-5, silu_mul=True) - F.silu(gate) * up).abs().max() < TOL


def test_qkv_rope_writes_the_pool_by_slot_and_by_table() -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    cs = _rope_table(200)
    w = torch.randn((H + 2 * HKV) * HD, 256, device=DEV, generator=g) * 0.05
    x = torch.randn(5, 256, device=DEV, generator=g)
    ref = F.linear(_unit(x), w)
    qk_ref = ref[:, : (H + HKV) * HD].view(5, H + HKV, HD)
    v_ref = ref[:, (H + HKV) * HD:].view(5, HKV, HD)

    kp, vp = torch.zeros(12, BS, HKV, HD, device=DEV), torch.zeros(12, BS, HKV, HD, device=DEV)
    pos = torch.tensor([3, 4, 5, 6, 7], device=DEV)
    slots = torch.tensor([19, 20, 21, 22, 35], device=DEV)
    q = fused.qkv_rope(x, w, cs, kp, vp, H, HKV, 1e-5, positions=pos, pos_add=1, slots=slots)
    rot = apply_signed_rope(qk_ref, cs[pos + 1])
    assert (q - rot[:, :H]).abs().max() < TOL
    assert (kp.view(-1, HKV, HD)[slots] - rot[:, H:]).abs().max() < TOL
    assert (vp.view(-1, HKV, HD)[slots] - v_ref).abs().max() < TOL
    untouched = torch.ones(kp.view(-1, HKV, HD).shape[0], dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert kp.view(-1, HKV, HD)[untouched].abs().max() == 0  # nothing else written

    # a chain's entries: index committed + entry_add through each row's block table, position index + 1
    kp.zero_(), vp.zero_()
    tables = torch.tensor([[3, 5, 7, 0], [1, 2, 0, 0]], device=DEV)
    committed = torch.tensor([20, 7], device=DEV)
    q2 = fused.qkv_rope(x[:2], w, cs, kp, vp, H, HKV, 1e-5, committed=committed, tables=tables, entry_add=1)
    e = committed + 1
    slot2 = tables[torch.arange(2, device=DEV), e // BS] * BS + e % BS
    rot2 = apply_signed_rope(qk_ref[:2], cs[e + 1])
    assert (q2 - rot2[:, :H]).abs().max() < TOL
    assert (kp.view(-1, HKV, HD)[slot2] - rot2[:, H:]).abs().max() < TOL
    assert (vp.view(-1, HKV, HD)[slot2] - v_ref[:2]).abs().max() < TOL


@pytest.mark.parametrize("per_row", [1, 3])
def test_paged_attention_causal_limits(per_row: int) -> None:
    g = torch.Generator(device=DEV).manual_seed(per_row)
    kp = torch.randn(12, BS, HKV, HD, device=DEV, generator=g)
    vp = torch.randn(12, BS, HKV, HD, device=DEV, generator=g)
    tables = torch.tensor([[3, 5, 7, 0], [1, 2, 0, 0]], device=DEV)
    positions = torch.tensor([30, 10] if per_row == 1 else [30, 31, 32, 10, 11, 12], device=DEV)
    q = torch.randn(2 * per_row, H, HD, device=DEV, generator=g)
    got = fused.paged_attention(q, kp, vp, tables, positions, 1, HD ** -0.5, per_row, 64)
    for t in range(2 * per_row):
        b, n = t // per_row, int(positions[t]) + 1  # keys [0, position]
        idx = torch.arange(n, device=DEV)
        sl = tables[b, idx // BS] * BS + idx % BS
        k = kp.view(-1, HKV, HD)[sl].repeat_interleave(H // HKV, 1)
        v = vp.view(-1, HKV, HD)[sl].repeat_interleave(H // HKV, 1)
        p = (torch.einsum("hd,nhd->hn", q[t], k) * HD ** -0.5).softmax(-1)
        assert (got[t] - torch.einsum("hn,nhd->hd", p, v)).abs().max() < TOL, t
