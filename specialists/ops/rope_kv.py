"""RoPE and the KV write in one Triton kernel, for the target's attention layers on CUDA in half
precision: from the fused q/k/v product it rotates q and k (rotate-half on the first R channels,
partial rotary keeps the rest), writes k and v into the paged pool at their slots and returns q. On
torch that is ~10 kernels per layer (slices, a negation, a concatenation, products and sums for q and
k, two index copies). Rotation in fp32, rounded once on the store. On CPU tensors it runs under
TRITON_INTERPRET=1 (tests); the engine's CPU path keeps rope.apply_rope and attention.write_kv.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rope_write_kv"]


@triton.jit(do_not_specialize=["stride_qkv", "stride_cs"])
def _rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, kp_ptr, vp_ptr, ko_ptr, stride_qkv, stride_cs,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_D: tl.constexpr,
                    K_OUT: tl.constexpr):
    t = tl.program_id(0)  # one token
    h = tl.program_id(1)  # one head: q heads, then k heads, then v heads
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    row = qkv_ptr + t.to(tl.int64) * stride_qkv + h * D
    x = tl.load(row + d, mask=dm, other=0.0).to(tl.float32)
    if h < HQ + HKV:  # q and k: x * cos + rotate_half(x) * sin on channels [0, R)
        rot = d < R
        first = d < R // 2
        partner = tl.where(first, d + R // 2, d - R // 2)
        xp = tl.load(row + partner, mask=rot, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t * stride_cs + d, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_cs + d, mask=rot, other=0.0).to(tl.float32)
        x = x * c + tl.where(first, -xp, xp) * s
    if h < HQ:
        tl.store(q_ptr + (t * HQ + h) * D + d, x, mask=dm)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if h < HQ + HKV:
            tl.store(kp_ptr + (slot * HKV + (h - HQ)) * D + d, x, mask=dm)
            if K_OUT:  # the rotated k of the step's tokens, in token order, as the pool holds it
                tl.store(ko_ptr + (t * HKV + (h - HQ)) * D + d, x, mask=dm)
        else:
            tl.store(vp_ptr + (slot * HKV + (h - HQ - HKV)) * D + d, x, mask=dm)


def rope_write_kv(
    qkv: torch.Tensor,  # [T, (H_q + 2 H_kv) * D], the fused product (bias added)
    cos: torch.Tensor,  # [T, R] (R <= D, even)
    sin: torch.Tensor,  # [T, R]
    k_cache_layer: torch.Tensor,  # [num_blocks, block_size, H_kv, D], written at slot_mapping
    v_cache_layer: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    slot_mapping: torch.Tensor,  # [T] int64 flat slots
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_out: torch.Tensor | None = None,  # [T, H_kv, D]: also gets the rotated k (as written to the pool)
) -> torch.Tensor:  # q [T, H_q, D], rotated
    T = qkv.shape[0]
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride(0) != cos.stride(0):
        raise ValueError("rope_write_kv wants row-major qkv and cos / sin of one layout")
    q = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if T:
        _rope_kv_kernel[(T, num_heads + 2 * num_kv_heads)](
            qkv, cos, sin, slot_mapping, q, k_cache_layer, v_cache_layer, q if k_out is None else k_out, qkv.stride(0),
            cos.stride(0), HQ=num_heads, HKV=num_kv_heads, D=head_dim, R=cos.shape[-1],
            BLOCK_D=triton.next_power_of_2(head_dim), K_OUT=k_out is not None)
    return q
