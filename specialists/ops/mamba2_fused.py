"""The Mamba2 mixer's decode / verify step in two Triton kernels (CUDA), between its two products.

For q new tokens per sequence (decode: 1, verify: K+1) the torch step (mamba2_steps.py) is ~40 small
kernels per layer (the conv's taps, softplus, the state's decay and update, the output, the gate and
the grouped RMSNorm, each a launch), most of a hybrid's decode time at real sizes. Here:

  zxbcdt = in_proj(u)                                          (the product, as before)
  step kernel, a program per (sequence, head, block of P):     for each of the q tokens in order:
      the depthwise conv over the window (the conv state, then the new inputs), SiLU; dt = clamp(
      softplus(dt + dt_bias)); state <- exp(dt A) state + dt x (outer) B; y = state . C + D x;
      y * silu(z); the conv and SSM states after the token are written (the engine commits one)
  norm kernel, a program per (token, group):                   RMSNorm of the group, times the norm weight
  out = out_proj(...)                                          (the product, as before)

Tried and reverted: the gated RMSNorm in out_proj's prologue (`mma` under a norm over the fp32 gated
output; session 30, 95d2efd). It saved a kernel a layer, no time beyond the noise (bamba-1b TPOT
1.092, 1.087 against 1.093, 1.090 ms, H200), and it broke exactness: on the H200 the cpp toy in bf16 at
batch 8, K=5, gave one of 32 held-out prompts other greedy tokens with speculation than without, from
its 101st token, and 8 of 8 equal with it off (session 31; the kernel-level cause was not isolated:
under that prologue a row's result apparently depends on the verify's 48 rows against a decode's 8).

Every token of a verify runs the instructions of a decode (a recurrence, not the closed form over q),
so a speculative step's states and outputs are a plain step's. Rounding follows the torch step: the
conv, dt and the normed output are rounded to the activation dtype where torch computes them in it;
the state, y and the gate are fp32. On CPU tensors it runs under TRITON_INTERPRET=1 (tests); the
engine uses it on CUDA only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specialists.ops.linear import exact_linear
from specialists.ops.mamba2 import Mamba2Params

__all__ = ["mamba2_layer_fused", "mamba2_step_fused", "mixer_step"]

_ACT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _round(x, ACT: tl.constexpr):
    """x (fp32) rounded to the activation dtype and back (a torch op computed in that dtype). bf16 by
    the bits, round to nearest even (Triton's interpreter truncates in .to(tl.bfloat16))."""
    if ACT == 1:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    elif ACT == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _conv_tap(zx_ptr, conv_ptr, b, t: tl.constexpr, k: tl.constexpr, col, ch, mask, stride_zx,
              Q: tl.constexpr, K1: tl.constexpr):
    """Input k of token t's conv window for channels ch (xBC columns col of zxbcdt): the conv state's
    for the taps before the new tokens, else the new token's."""
    s: tl.constexpr = t + k - K1
    if s < 0:
        return tl.load(conv_ptr + ch * K1 + (K1 + s), mask=mask, other=0.0).to(tl.float32)
    return tl.load(zx_ptr + (b * Q + s) * stride_zx + col, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _conv_out(zx_ptr, conv_ptr, cw_ptr, cb_ptr, b, t: tl.constexpr, col, ch, mask, stride_zx,
              Q: tl.constexpr, KC: tl.constexpr, HAS_CB: tl.constexpr, ACT: tl.constexpr):
    """silu(conv) of token t for channels ch, rounded as torch's step in the activation dtype."""
    K1: tl.constexpr = KC - 1
    acc = tl.zeros(ch.shape, tl.float32)
    for k in tl.static_range(KC):
        v = _conv_tap(zx_ptr, conv_ptr, b, t, k, col, ch, mask, stride_zx, Q, K1)
        w = tl.load(cw_ptr + ch * KC + k, mask=mask, other=0.0).to(tl.float32)
        acc += _round(v * w, ACT)
    acc = _round(acc, ACT)
    if HAS_CB:
        acc = _round(acc + tl.load(cb_ptr + ch, mask=mask, other=0.0).to(tl.float32), ACT)
    return _round(acc * tl.sigmoid(acc), ACT)


@triton.jit
def _write_conv_state(zx_ptr, conv_ptr, out_ptr, b, t: tl.constexpr, col, ch, mask, stride_zx,
                      Q: tl.constexpr, K1: tl.constexpr):
    """The conv state after token t (its last K1 inputs) for channels ch -> out_ptr (token t's [CONV, K1])."""
    for j in tl.static_range(K1):
        v = _conv_tap(zx_ptr, conv_ptr, b, t, j + 1, col, ch, mask, stride_zx, Q, K1)
        tl.store(out_ptr + ch * K1 + j, v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _step_kernel(zx_ptr, conv_ptr, state_ptr, cw_ptr, cb_ptr, dtb_ptr, alog_ptr, d_ptr,
                 yg_ptr, conv_out_ptr, state_out_ptr, slot_ptr, dt_lo, dt_hi, stride_zx, stride_cb, stride_sb,
                 co_b, co_t, so_b, so_t, Q: tl.constexpr, H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, G: tl.constexpr,
                 DIN: tl.constexpr, KC: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                 HAS_CB: tl.constexpr, HAS_SLOTS: tl.constexpr, ACT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    r = b  # the row of the input states: the sequence's slot in the cache, or b
    if HAS_SLOTS:
        r = tl.load(slot_ptr + b)
    conv_ptr += r * stride_cb  # the input conv state's row ([CONV, K1] contiguous)
    K1: tl.constexpr = KC - 1
    CONV: tl.constexpr = DIN + 2 * G * N
    g = h // (H // G)
    p = pb * BP + tl.arange(0, BP)
    pm = p < P
    n = tl.arange(0, BN)
    nm = n < N
    cx = h * P + p  # xBC channels of x, B and C (zxbcdt columns: DIN + channel)
    cB = DIN + g * N + n
    cC = DIN + G * N + g * N + n
    sm = pm[:, None] & nm[None, :]
    state = tl.load(state_ptr + r * stride_sb + (h * P + p[:, None]) * N + n[None, :], mask=sm, other=0.0).to(tl.float32)
    A = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    Dh = tl.load(d_ptr + h).to(tl.float32)
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    owns_bc = (h % (H // G) == 0) & (pb == 0)  # one program writes a group's B / C conv states
    for t in tl.static_range(Q):
        x = _conv_out(zx_ptr, conv_ptr, cw_ptr, cb_ptr, b, t, DIN + cx, cx, pm, stride_zx, Q, KC, HAS_CB, ACT)
        Bv = _conv_out(zx_ptr, conv_ptr, cw_ptr, cb_ptr, b, t, DIN + cB, cB, nm, stride_zx, Q, KC, HAS_CB, ACT)
        Cv = _conv_out(zx_ptr, conv_ptr, cw_ptr, cb_ptr, b, t, DIN + cC, cC, nm, stride_zx, Q, KC, HAS_CB, ACT)
        row = zx_ptr + (b * Q + t) * stride_zx
        dt = _round(tl.load(row + DIN + CONV + h).to(tl.float32) + dtb, ACT)
        e = tl.exp(-tl.abs(dt))  # softplus (torch's threshold 20), log1p(e) without cancellation
        dt = _round(tl.where(dt > 20.0, dt, tl.maximum(dt, 0.0) + tl.where(e < 1e-4, e - 0.5 * e * e, tl.log(1.0 + e))), ACT)
        dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
        xdt = x * dt
        state = state * tl.exp(dt * A) + xdt[:, None] * Bv[None, :]
        y = tl.sum(state * Cv[None, :], axis=1) + Dh * x
        z = tl.load(row + cx, mask=pm, other=0.0).to(tl.float32)
        tl.store(yg_ptr + (b * Q + t) * DIN + cx, y * (z * tl.sigmoid(z)), mask=pm)
        tl.store(state_out_ptr + b * so_b + t * so_t + (h * P + p[:, None]) * N + n[None, :], state, mask=sm)
        cout = conv_out_ptr + b * co_b + t * co_t
        _write_conv_state(zx_ptr, conv_ptr, cout, b, t, DIN + cx, cx, pm, stride_zx, Q, K1)
        if owns_bc:
            _write_conv_state(zx_ptr, conv_ptr, cout, b, t, DIN + cB, cB, nm, stride_zx, Q, K1)
            _write_conv_state(zx_ptr, conv_ptr, cout, b, t, DIN + cC, cC, nm, stride_zx, Q, K1)


@triton.jit
def _norm_kernel(yg_ptr, w_ptr, out_ptr, eps, DIN: tl.constexpr, GS: tl.constexpr, BLOCK: tl.constexpr,
                 ACT: tl.constexpr):
    r = tl.program_id(0)
    g = tl.program_id(1)
    i = g * GS + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < GS
    v = tl.load(yg_ptr + r * DIN + i, mask=m, other=0.0)
    v = _round(v * tl.rsqrt(tl.sum(v * v, axis=0) / GS + eps), ACT)
    w = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * DIN + i, (w * v).to(out_ptr.dtype.element_ty), mask=m)


def mamba2_step_fused(
    p: Mamba2Params,
    u: torch.Tensor,  # [B, q, d] normed inputs
    conv_state: torch.Tensor,  # [B, conv_dim, K-1], or [slots, ...] with `slots`
    ssm_state: torch.Tensor,  # [B, H, P, N] fp32, or [slots, ...] with `slots`
    slots: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mamba2_multi_step's contract: (y [B, q, d], conv_states [B, q, conv_dim, K-1], ssm_states
    [B, q, H, P, N] fp32), the states after each token; the inputs are not modified. `slots` [B]
    (int64, device): sequence b's input states are row slots[b] of conv_state / ssm_state (the cache's
    layer views, read in place); `out`: the states are written into these [B, q, ...] views (rows and
    tokens strided, each token's state contiguous) and returned."""
    if u.dtype not in _ACT:
        raise ValueError(f"unsupported activation dtype {u.dtype}")
    B, q, d = u.shape
    zx = exact_linear(u.reshape(B * q, d), p.in_proj_weight, p.in_proj_bias)  # [B q, d_inner + conv_dim + H]
    normed, convs, states = mixer_step(p, zx, B, q, conv_state, ssm_state, slots, out)
    return exact_linear(normed, p.out_proj_weight, p.out_proj_bias).view(B, q, -1), convs, states


def mamba2_layer_fused(p: Mamba2Params, u: torch.Tensor | None, h: torch.Tensor, B: int, q: int, conv_state: torch.Tensor,
                       ssm_state: torch.Tensor, slots: torch.Tensor | None, out: tuple[torch.Tensor, torch.Tensor]) -> None:
    """A hybrid's Mamba layer on the decode path (decode_fused.enabled(h): CUDA, half precision, at most
    MAX_ROWS rows): h [B q, d] += mixer(u), u = rms_norm(h) * gain [B q, d], in place, with the residual
    add in out_proj's epilogue (one kernel fewer a layer); the states as mamba2_step_fused's `out`. u
    None: the norm's gain is folded into in_proj (p.folded_norm_eps), which streams h under the norm's
    scale; with u given the RMSNorm was a kernel of its own (in in_proj's prologue with the gain in the
    loop the product took 18.8-21.9 us at bamba-1b against 14.9 plus a 3.7 us norm, H100, session 29)."""
    from specialists.ops import decode_fused  # Triton: a GPU install has it

    if u is None:
        zx = decode_fused.mma(h, p.in_proj_weight, p.in_proj_bias, eps=p.folded_norm_eps, folded=True)
    else:
        zx = exact_linear(u, p.in_proj_weight, p.in_proj_bias)
    normed, _, _ = mixer_step(p, zx, B, q, conv_state, ssm_state, slots, out)
    decode_fused.mma(normed, p.out_proj_weight, p.out_proj_bias, residual=h)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, ...] with each row contiguous (rows may be strided: a cache's layer, a staged token)."""
    return x if x[0].is_contiguous() else x.contiguous()


def _out_views(out: tuple[torch.Tensor, torch.Tensor] | None, B: int, q: int, conv_shape: tuple, ssm_shape: tuple,
               conv_dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        return (torch.empty(B, q, *conv_shape, dtype=conv_dtype, device=device),
                torch.empty(B, q, *ssm_shape, dtype=torch.float32, device=device))
    convs, states = out
    if tuple(convs.shape) != (B, q, *conv_shape) or tuple(states.shape) != (B, q, *ssm_shape) or \
            states.dtype != torch.float32 or convs.dtype != conv_dtype:
        raise ValueError(f"out {tuple(convs.shape)} {convs.dtype} / {tuple(states.shape)} {states.dtype} != "
                         f"[{B}, {q}, {conv_shape}] {conv_dtype} / [{B}, {q}, {ssm_shape}] float32")
    if not (convs[0, 0].is_contiguous() and states[0, 0].is_contiguous()):
        raise ValueError("out: each token's conv and SSM state must be contiguous")
    return convs, states


def mixer_step(p: Mamba2Params, zx: torch.Tensor, B: int, q: int, conv_state: torch.Tensor, ssm_state: torch.Tensor,
               slots: torch.Tensor | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Between the products: zxbcdt [B q, ...] (row b*q + t: sequence b's token t) -> the normed, gated
    output [B q, d_inner] in zx's dtype (out_proj's input), and the conv and SSM states after each token
    (`slots`, `out`: mamba2_step_fused)."""
    H, P, N, G, KC = p.num_heads, p.head_dim, p.d_state, p.n_groups, p.d_conv
    DIN = p.d_inner
    conv_state = _rows(conv_state)
    ssm_state = _rows(ssm_state.float())
    yg = torch.empty(B * q, DIN, dtype=torch.float32, device=zx.device)
    convs, states = _out_views(out, B, q, (p.conv_dim, KC - 1), (H, P, N), conv_state.dtype, zx.device)
    BP = min(16, triton.next_power_of_2(P))
    lo, hi = p.time_step_limit
    cb = p.conv_bias if p.conv_bias is not None else p.conv_weight
    _step_kernel[(B, H, triton.cdiv(P, BP))](
        zx, conv_state, ssm_state, p.conv_weight, cb, p.dt_bias, p.A_log, p.D, yg, convs, states,
        slots if slots is not None else zx, float(lo), float(hi), zx.stride(0), conv_state.stride(0), ssm_state.stride(0),
        convs.stride(0), convs.stride(1), states.stride(0), states.stride(1), Q=q, H=H, P=P, N=N, G=G, DIN=DIN, KC=KC,
        BP=BP, BN=triton.next_power_of_2(N), HAS_CB=p.conv_bias is not None, HAS_SLOTS=slots is not None,
        ACT=_ACT[zx.dtype], num_warps=4)
    normed = torch.empty(B * q, DIN, dtype=zx.dtype, device=zx.device)
    GS = DIN // G
    _norm_kernel[(B * q, G)](yg, p.norm_weight, normed, float(p.norm_eps), DIN=DIN, GS=GS,
                             BLOCK=triton.next_power_of_2(GS), ACT=_ACT[zx.dtype], num_warps=4)
    return normed, convs, states
