"""specialists/ops/rope_kv.py (RoPE + KV write in one Triton kernel, the target's CUDA half-precision
path) against rope.apply_rope + attention.write_kv, through Triton's interpreter on CPU
(tests/conftest.py sets TRITON_INTERPRET=1): full and partial rotary, GQA, a fused bias-free product
of several tokens at scattered slots; nothing else in the pool is written."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1", allow_module_level=True)

from specialists.models.rope import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402
from specialists.ops.attention import write_kv  # noqa: E402
from specialists.ops.rope_kv import rope_write_kv  # noqa: E402


@pytest.mark.parametrize("hq,hkv,d,r", [(4, 2, 64, 64), (6, 2, 32, 16), (3, 3, 64, 32)])
def test_rope_write_kv_matches_torch(hq: int, hkv: int, d: int, r: int) -> None:
    g = torch.Generator().manual_seed(hq * 100 + r)
    T, nb, bs = 5, 8, 4
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g).to(torch.bfloat16)
    positions = torch.tensor([0, 3, 17, 18, 40])
    cos, sin = rope_cos_sin(positions, rope_inv_freq(10000.0, r), torch.bfloat16)
    slots = torch.tensor([5, 6, 13, 30, 1])
    kp, vp = torch.zeros(nb, bs, hkv, d, dtype=torch.bfloat16), torch.zeros(nb, bs, hkv, d, dtype=torch.bfloat16)
    q = rope_write_kv(qkv, cos, sin, kp, vp, slots, hq, hkv, d)

    ref = qkv.float()
    qk = apply_rope(ref[:, : (hq + hkv) * d].view(T, hq + hkv, d), cos.float()[:, None], sin.float()[:, None])
    kr, vr = torch.zeros(nb, bs, hkv, d), torch.zeros(nb, bs, hkv, d)
    write_kv(qk[:, hq:], ref[:, (hq + hkv) * d:].view(T, hkv, d), kr, vr, slots)
    torch.testing.assert_close(q.float(), qk[:, :hq], atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(kp.float(), kr, atol=2e-2, rtol=1e-2)
    assert torch.equal(vp.float(), vr)  # v is copied, not rotated
    k_out = torch.zeros(T, hkv, d, dtype=torch.bfloat16)  # the rotated k in token order too (a fresh prefill's)
    kp2, vp2 = torch.zeros_like(kp), torch.zeros_like(vp)
    assert torch.equal(rope_write_kv(qkv, cos, sin, kp2, vp2, slots, hq, hkv, d, k_out=k_out), q)
    assert torch.equal(k_out, kp.view(nb * bs, hkv, d)[slots]) and torch.equal(kp2, kp) and torch.equal(vp2, vp)
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots] = False
    assert not kp.view(nb * bs, hkv, d)[untouched].any() and not vp.view(nb * bs, hkv, d)[untouched].any()
