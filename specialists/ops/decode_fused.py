"""The target's decode and verify steps on CUDA in half precision, with fewer kernels (issue 16).

A Llama layer's step at a few rows was 15 kernels on torch ops: two RMSNorms (torch's kernel costs
~3 us at d = 2048 and one row), two residual adds, SiLU and its product, and the products as cuBLAS
GEMMs (at one row 1.4-2.6 TB/s, some split-K with a reduction kernel). At real sizes the gaps between
kernels and the small kernels' fixed cost held a 1B model at 2.3x its bandwidth bound. Two paths:

  mma (at most MAX_ROWS rows: every decode and verify step of up to 8 sequences at K <= 7; the engine
      caps K so that a step stays within it, specialists/staging.exact_rows):
      four products per layer, each a Triton kernel on the tensor cores that carries its neighbours:
      RMSNorm before q/k/v and gate/up, SiLU * up before down, the residual add after o and down (in
      place). A layer is 6 kernels with RoPE + KV write and the attention. The rows sit in
      a tile of 16, 32 or 64 (the rest zeros) and the weights stream once, so 1 to 16 rows cost the
      same (llama-1b's layer: 59.4 us at one row, 59.8 at eight; bench/RESULTS.md). Every row runs the
      same instructions whatever the row count, its slot or the tile (the tensor cores accumulate a
      row's products alike in each), and K splits by the weight's shape alone with the partials summed
      in order: a verify of K+1 tokens computes exactly what the decodes of those tokens compute, and a
      request's tokens do not depend on the batch it shares (the exactness contract).
      With the norms' gains folded into q/k/v and gate/up (models/llama.fold_norm_gain) x streams as it
      is and gate/up carries the SwiGLU at its end (two accumulators, the unfused roundings), so down is
      a plain product (mma kinds 3 and 4; tiles in ops/mma_config.py).
  gemm pieces (rms_norm, silu_mul, add_product: cuBLAS with the residual as the GEMM's C operand) are
      bench.fused_products' comparison only: the engine took them above 32 rows until a verify of 48
      rows (batch 8, K=5, bf16) gave other greedy tokens than its decodes (cuBLAS picks its kernel by
      the row count).

The rounding: the SiLU and its product are rounded to the model's dtype before a product, as the torch
ops round; under the RMSNorm, x * gain is rounded and the product scaled by the row's rsqrt(mean(x^2)
+ eps) after (the norm's sum of squares accumulates in the same pass over x); products accumulate in
fp32 and are rounded before the residual add. Prefills keep the torch ops. With TRITON_INTERPRET=1
the kernels run on CPU tensors (tests). CANTATA_FUSED_DECODE=0 turns both paths off (A/B runs).

On Hopper, products of small weights (PDL_BYTES) launch early under programmatic dependent launch
and pull their weights into L2 while the kernel before them finishes (CANTATA_PDL=0: off).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from specialists.ops.attention import HALF
from specialists.ops.mma_config import mma_config

__all__ = ["enabled", "rms_norm", "silu_mul", "add_product", "mma", "mma_config", "pdl", "launches_early", "MAX_ROWS",
           "RopeKV", "rope_fuses"]

MAX_ROWS = 64  # decodes and verifies of up to 8 sequences at K = 7 (prefills keep the torch ops)


def enabled(x: torch.Tensor) -> bool:
    """x [rows, d]: a CUDA half-precision step of at most MAX_ROWS rows."""
    return (x.is_cuda and x.dtype in HALF and 0 < x.shape[0] <= MAX_ROWS
            and os.environ.get("CANTATA_FUSED_DECODE", "1") != "0")


@triton.jit(do_not_specialize=["stride_x", "stride_out"])
def _rms_norm_kernel(x_ptr, g_ptr, out_ptr, stride_x, stride_out, eps, D: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    dm = d < D
    x = tl.load(x_ptr + r * stride_x + d, mask=dm, other=0.0).to(tl.float32)
    rs = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    g = tl.load(g_ptr + d, mask=dm, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * stride_out + d, x * rs * g, mask=dm)


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, d] -> x * rsqrt(mean(x^2) + eps) * gain, in fp32, rounded once (torch's fused rms_norm on
    CUDA, in one program per row: torch's kernel costs ~3.6 us at d = 2048 and one row)."""
    m, d = x.shape
    out = torch.empty_like(x)
    _rms_norm_kernel[(m,)](x, gain, out, x.stride(0), out.stride(0), eps, D=d, BLOCK=triton.next_power_of_2(d))
    return out


@triton.jit(do_not_specialize=["stride_x", "stride_out"])
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, I: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = c < I
    gate = tl.load(x_ptr + r * stride_x + c, mask=cm, other=0.0)
    up = tl.load(x_ptr + r * stride_x + I + c, mask=cm, other=0.0)
    g32 = gate.to(tl.float32)
    s = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    tl.store(out_ptr + r * stride_out + c, s.to(tl.float32) * up.to(tl.float32), mask=cm)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu = [gate | up] [M, 2I] -> silu(gate) * up [M, I], each rounded to gu's dtype as torch's two
    kernels round (F.silu, then the product), in one kernel."""
    m, i2 = gu.shape
    i = i2 // 2
    out = torch.empty(m, i, dtype=gu.dtype, device=gu.device)
    block = min(2048, triton.next_power_of_2(i))
    _silu_mul_kernel[(m, triton.cdiv(i, block))](gu, out, gu.stride(0), out.stride(0), I=i, BLOCK=block)
    return out


def add_product(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """h += x @ W^T (+ bias), in place: cuBLAS's GEMM with the residual as its C operand (beta = 1), so
    the add costs no kernel of its own. Returns h."""
    h.addmm_(x, w.t())
    if bias is not None:
        h += bias
    return h


_LOCKS: dict[torch.device, torch.Tensor] = {}
LOCK_SLOTS = 1 << 16  # arrival counters at most: a split-K product's column blocks, the attention's (token, head)s


def arrival_locks(device: torch.device, n: int) -> torch.Tensor:
    """Arrival counters, zero between calls: a split-K product's per column block, the decode
    attention's per (token, KV head) (attention_cuda.py); the last program to arrive resets its
    counter. One buffer per device, never replaced: captured graphs keep its address. Kernels that
    use it run one after another on a stream, each leaving it zeroed."""
    if n > LOCK_SLOTS:
        raise ValueError(f"{n} arrival counters asked for (at most {LOCK_SLOTS})")
    t = _LOCKS.get(device)
    if t is None:
        t = _LOCKS[device] = torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=device)
    return t


_SCRATCH: dict[torch.device, list[torch.Tensor]] = {}


def scratch(device: torch.device, n: int) -> torch.Tensor:
    """n fp32 words a kernel's programs share while it runs (a split-K product's partials, the decode
    attention's chunk partials, attention_cuda.py): the first n of one buffer per device, grown by
    doubling and never freed (captured graphs keep the addresses they were captured with). Kernels
    run one after another on a stream, and one launched early (PDL) writes only after the kernel before
    it has finished, so one buffer serves them all. Allocated per call, these partials took each
    graph's private memory pool ~30 MB (llama-1b, width 2048: a verify's attention 34 MB a layer)."""
    bufs = _SCRATCH.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.empty(max(n, 2 * bufs[-1].numel() if bufs else 1 << 18), dtype=torch.float32, device=device))
    return bufs[-1][:n]


_PDL: dict[torch.device, bool] = {}
# Programmatic dependent launch for products whose weight is at most this many bytes: the product
# launches as soon as every program of the kernel before it runs (that kernel lets it: a product
# launched early, or the attention before an early o product), asks L2 for its whole weight slice,
# then waits for that kernel (complete, its writes visible). smollm2-135m's products (0.7-3.5 MB)
# stream while the kernel before finishes: 0.92-1.03 ms a token against 1.07-1.24 without (H100,
# 2026-11-26 session 11). Larger products keep the plain launch: with it llama-1b was 3-6% slower,
# with or without the prefetch (a 67 MB gate/up's prefetches evict each other).
PDL_BYTES = int(float(os.environ.get("CANTATA_PDL_MB", "4")) * (1 << 20))


def pdl(device: torch.device) -> bool:
    """Programmatic dependent launch on this device: Hopper or later, CANTATA_PDL not 0."""
    if device not in _PDL:
        _PDL[device] = (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
                        and os.environ.get("CANTATA_PDL", "1") != "0")
    return _PDL[device]


def launches_early(w: torch.Tensor) -> bool:
    """Whether `mma` launches the product of weight w under programmatic dependent launch."""
    return pdl(w.device) and w.numel() * w.element_size() <= PDL_BYTES


@triton.jit
def _await_inputs(w_ptr, wrow, mn, pk, up, K: tl.constexpr, KS: tl.constexpr, BLOCK_K: tl.constexpr,
                  PDL: tl.constexpr, GLU: tl.constexpr):
    """Under PDL: lets the next kernel launch, asks L2 for this program's weight slice (one prefetch
    per 128-byte line; with GLU its up rows too, `up` elements on) while the kernel before still runs,
    then waits for that kernel."""
    if PDL:
        gdc_launch_dependents()
        for c0 in range(0, KS, BLOCK_K):
            cols = pk * KS + c0 + tl.arange(0, BLOCK_K // 64) * 64
            ptrs = tl.where(mn[:, None] & (cols < K)[None, :], wrow + cols[None, :], w_ptr)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                                      is_pure=False, pack=1)
            if GLU:
                tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs + up], dtype=tl.int32,
                                          is_pure=False, pack=1)
        gdc_wait()


@triton.jit
def _store_rows(acc, optr, mo, bptr, mn, RES: tl.constexpr, BIAS: tl.constexpr, dt: tl.constexpr):
    """out = round(acc (+ bias)), or out = round(out + round(acc (+ bias))) with the residual."""
    if BIAS:
        acc += tl.load(bptr, mask=mn, other=0.0).to(tl.float32)[:, None]
    y = acc.to(dt)
    if RES:
        y = (tl.load(optr, mask=mo, other=0.0).to(tl.float32) + y.to(tl.float32)).to(dt)
    tl.store(optr, y, mask=mo)


@triton.jit
def _store_glu(acc, acc2, optr, mo, bptr, bptr2, mn, BIAS: tl.constexpr, dt: tl.constexpr):
    """out = silu(gate) * up from the two accumulators, rounded as the unfused path rounds: gate and up
    to dt (as the product stores them), the SiLU to dt, their product to dt."""
    if BIAS:
        acc += tl.load(bptr, mask=mn, other=0.0).to(tl.float32)[:, None]
        acc2 += tl.load(bptr2, mask=mn, other=0.0).to(tl.float32)[:, None]
    gate = acc.to(dt).to(tl.float32)
    up = acc2.to(dt).to(tl.float32)
    tl.store(optr, ((gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up).to(dt), mask=mo)


@triton.jit
def _store_qkv_rope(acc, pn, rm, mm, bptr, q_ptr, cos_ptr, sin_ptr, stride_cs, slot_ptr, kp_ptr, vp_ptr,
                    BIAS: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                    dt: tl.constexpr):
    """The q/k/v product's end, one head a program (BLOCK_N = D): y = round(acc (+ bias)); a q or k head
    rotated (rotate-half on all D channels, fp32, rounded once: ops/rope_kv.py's arithmetic); q stored
    [M, HQ, D], k and v into the paged pool at the rows' slots."""
    d = tl.arange(0, D)
    if BIAS:
        acc += tl.load(bptr + pn * D + d).to(tl.float32)[:, None]
    y = acc.to(dt).to(tl.float32)  # [D, BLOCK_M]: the rounded product, as the unfused path stores it
    if pn < HQ + HKV:
        cs = rm[None, :] * stride_cs + d[:, None]
        c1, c2 = tl.split(tl.permute(tl.reshape(tl.load(cos_ptr + cs, mask=mm[None, :], other=1.0).to(tl.float32),
                                                (2, D // 2, BLOCK_M)), (1, 2, 0)))
        s1, s2 = tl.split(tl.permute(tl.reshape(tl.load(sin_ptr + cs, mask=mm[None, :], other=0.0).to(tl.float32),
                                                (2, D // 2, BLOCK_M)), (1, 2, 0)))
        a, b = tl.split(tl.permute(tl.reshape(y, (2, D // 2, BLOCK_M)), (1, 2, 0)))  # the two halves of each row
        y = tl.reshape(tl.permute(tl.join(a * c1 + (-b) * s1, b * c2 + a * s2), (2, 0, 1)), (D, BLOCK_M))
    out = y.to(dt)
    if pn < HQ:
        tl.store(q_ptr + rm[None, :] * (HQ * D) + pn * D + d[:, None], out, mask=mm[None, :])
    else:
        slot = tl.load(slot_ptr + rm, mask=mm, other=0).to(tl.int64)
        if pn < HQ + HKV:
            tl.store(kp_ptr + (slot[None, :] * HKV + (pn - HQ)) * D + d[:, None], out, mask=mm[None, :])
        else:
            tl.store(vp_ptr + (slot[None, :] * HKV + (pn - HQ - HKV)) * D + d[:, None], out, mask=mm[None, :])


@triton.jit
def _operand(xrow, g_ptr, rk, mk, mx, ss, K: tl.constexpr, PRO: tl.constexpr, dt: tl.constexpr):
    """The rows' [BLOCK_M, BLOCK_K] tile of a product's x operand after the kind's prologue (0 plain, 1
    x * gain under the RMSNorm, 2 silu(gate) * up, 3 x under a norm whose gain is in w) and the norm's
    running sum of squares."""
    if PRO == 3:
        a = tl.load(xrow + rk[None, :], mask=mx, other=0.0)
        xf = a.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
    elif PRO == 2:
        gate = tl.load(xrow + rk[None, :], mask=mx, other=0.0).to(tl.float32)
        up = tl.load(xrow + K + rk[None, :], mask=mx, other=0.0).to(tl.float32)
        a = ((gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up).to(dt)
    elif PRO == 1:
        xv = tl.load(xrow + rk[None, :], mask=mx, other=0.0).to(tl.float32)
        ss += tl.sum(xv * xv, axis=1)
        a = (xv * tl.load(g_ptr + rk, mask=mk, other=0.0).to(tl.float32)[None, :]).to(dt)
    else:
        a = tl.load(xrow + rk[None, :], mask=mx, other=0.0)
    return a, ss


@triton.jit(do_not_specialize=["M", "N", "stride_cs"])
def _mma_kernel(x_ptr, w_ptr, out_ptr, g_ptr, b_ptr, ws_ptr, ss_ptr, lock_ptr, M, N, K: tl.constexpr, stride_x, stride_w,
                stride_out, eps, cos_ptr, sin_ptr, stride_cs, slot_ptr, kp_ptr, vp_ptr, PRO: tl.constexpr, RES: tl.constexpr,
                BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                KS: tl.constexpr, PDL: tl.constexpr, ROPE: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                GLU: tl.constexpr = False):
    """Program (n, s) streams BLOCK_N weight rows (GLU: rows rn and N + rn, two accumulators) over the
    s-th of SPLIT ranges of K and multiplies each tile with the rows' [BLOCK_M, BLOCK_K] tile on the
    tensor cores (rows past M are zeros). With SPLIT > 1 each writes its fp32 partial; the last of a
    column block to arrive sums the partials in order and finishes. Every row runs the same
    instructions whatever M and its slot, so a row's result depends on neither."""
    pn, pk = tl.program_id(0), tl.program_id(1)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    mn, mm = rn < N, rm < M
    dt = w_ptr.dtype.element_ty
    wrow = w_ptr + rn.to(tl.int64)[:, None] * stride_w
    xrow = x_ptr + rm.to(tl.int64)[:, None] * stride_x
    _await_inputs(w_ptr, wrow, mn, pk, N.to(tl.int64) * stride_w, K, KS, BLOCK_K, PDL, GLU)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    ss = tl.zeros((BLOCK_M,), tl.float32)
    for k0 in range(0, KS, BLOCK_K):
        rk = pk * KS + k0 + tl.arange(0, BLOCK_K)  # past K: masked (zeros)
        mk = rk < K
        w = tl.load(wrow + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        a, ss = _operand(xrow, g_ptr, rk, mk, mm[:, None] & mk[None, :], ss, K, PRO, dt)
        acc = tl.dot(w, tl.trans(a), acc)
        if GLU:
            w2 = tl.load(wrow + N * stride_w + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
            acc2 = tl.dot(w2, tl.trans(a), acc2)
    last = True
    if SPLIT > 1:
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + rm[None, :]
        tl.store(ws_ptr + (pn * SPLIT + pk) * BLOCK_N * BLOCK_M + tile, acc)
        if PRO == 1 or PRO == 3:
            tl.store(ss_ptr + (pn * SPLIT + pk) * BLOCK_M + rm, ss)
        tl.debug_barrier()
        last = tl.atomic_add(lock_ptr + pn, 1, sem="acq_rel") == SPLIT - 1
        if last:
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            ss = tl.zeros((BLOCK_M,), tl.float32)
            for s in tl.static_range(SPLIT):
                acc += tl.load(ws_ptr + (pn * SPLIT + s) * BLOCK_N * BLOCK_M + tile, cache_modifier=".cg")
                if PRO == 1 or PRO == 3:
                    ss += tl.load(ss_ptr + (pn * SPLIT + s) * BLOCK_M + rm, cache_modifier=".cg")
            tl.atomic_xchg(lock_ptr + pn, 0)
    if last:
        if PRO == 1 or PRO == 3:
            scale = tl.rsqrt(ss / K + eps)[None, :]
            acc, acc2 = acc * scale, acc2 * scale  # acc2 only read with GLU (else compiled away)
        if GLU:
            _store_glu(acc, acc2, out_ptr + rm[None, :] * stride_out + rn[:, None], mn[:, None] & mm[None, :], b_ptr + rn,
                       b_ptr + N + rn, mn, BIAS, dt)
        elif ROPE:
            _store_qkv_rope(acc, pn, rm, mm, b_ptr, out_ptr, cos_ptr, sin_ptr, stride_cs, slot_ptr, kp_ptr, vp_ptr, BIAS, HQ,
                            HKV, BLOCK_N, BLOCK_M, dt)
        else:
            _store_rows(acc, out_ptr + rm[None, :] * stride_out + rn[:, None], mn[:, None] & mm[None, :], b_ptr + rn, mn,
                        RES, BIAS, dt)


class RopeKV(NamedTuple):
    """What a q/k/v product carries after it (`mma(rope=...)`): RoPE on q and k, k and v into the pool."""

    cos: torch.Tensor  # [M, D] (rows of the step's tokens; all D channels rotate)
    sin: torch.Tensor  # [M, D]
    slots: torch.Tensor  # [M] int64 flat KV slots
    k_cache: torch.Tensor  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor
    heads: int
    kv_heads: int


def rope_fuses(w: torch.Tensor, head_dim: int, cos: torch.Tensor, sin: torch.Tensor, folded: bool = False) -> bool:
    """Whether the q/k/v product of weight w (under the RMSNorm) carries RoPE and the KV write: a
    program's columns are one head (its config's BLOCK_N is the head size), K is not split, every
    channel rotates, and CANTATA_FUSED_ROPE is not 0. Else ops/rope_kv.py's kernel runs after it.
    (The split-K variant is exact in the tests, but the H100's ptxas crashed (-11) compiling it at
    llama-1b's q/k/v config, K 2048 split 2, 2026-11-27: unsplit products only.)"""
    bn, _, _, _, split = mma_config(3 if folded else 1, *w.shape)
    return (bn == head_dim and split == 1 and cos.shape[-1] == head_dim and cos.stride(-1) == 1
            and sin.stride() == cos.stride() and os.environ.get("CANTATA_FUSED_ROPE", "1") != "0")


def mma(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, gain: torch.Tensor | None = None,
        eps: float = 0.0, swiglu: bool = False, residual: torch.Tensor | None = None,
        config: tuple[int, int, int, int, int] | None = None, rope: RopeKV | None = None, glu: bool = False,
        folded: bool = False) -> torch.Tensor:
    """Weight products of up to MAX_ROWS rows with their neighbours carried: x [M, K] (gain given:
    rms_norm(x) * gain; folded: rms_norm(x) with the gain folded into w's columns; swiglu: x = [gate |
    up] [M, 2K] -> silu(gate) * up) -> W @ a (+ bias) [M, N]; glu: w = [gate | up] [2N, K] -> silu(gate
    product) * up product [M, N]; with `residual` [M, N] the result is added to it in place (and it is
    returned); with `rope` (a q/k/v product where rope_fuses) -> q [M, heads, D] rotated, k rotated and v
    written into the pool. A row's result does not depend on the other rows nor on M (a verify computes its decodes' products,
    bit for bit)."""
    m = x.shape[0]
    n, k = w.shape
    if glu:
        n //= 2
    if m > MAX_ROWS:
        raise ValueError(f"mma takes at most {MAX_ROWS} rows, got {m}")
    if x.stride(-1) != 1 or w.stride(-1) != 1 or x.shape[1] != (2 * k if swiglu else k):
        raise ValueError(f"mma wants row-major operands: x {tuple(x.shape)}, w {tuple(w.shape)}")
    out = residual if residual is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    pro = 2 if swiglu else (1 if gain is not None else (3 if folded else 0))
    bn, bk, warps, stages, split = config or mma_config(4 if glu else pro, n, k)
    if glu and (split > 1 or rope is not None or residual is not None or swiglu):
        raise ValueError("mma's glu end takes an unsplit product without RoPE, residual or a SwiGLU prologue")
    r = rope if rope is not None else RopeKV(w, w, w, w, w, 0, 0)
    if rope is not None:
        if bn != n // (rope.heads + 2 * rope.kv_heads) or rope.cos.shape[-1] != bn or residual is not None:
            raise ValueError(f"mma carries RoPE only with a head a program (BLOCK_N {bn}, weight {tuple(w.shape)})")
        out = torch.empty(m, rope.heads, bn, dtype=x.dtype, device=x.device)
    bm = max(16, triton.next_power_of_2(m))
    tiles = (2 if glu else 1) * bn + bm * (2 if swiglu else 1)
    stages = max(1, min(stages, 200_000 // (tiles * bk * x.element_size())))
    blocks = triton.cdiv(n, bn)
    ws = ss = locks = out
    if split > 1:
        n_ws = blocks * split * bn * bm
        ws = scratch(x.device, n_ws + blocks * split * bm)
        ws, ss = ws[:n_ws], ws[n_ws:]
        locks = arrival_locks(x.device, blocks)
    early = launches_early(w) and bk >= 64
    _mma_kernel[(blocks, split)](
        x, w, out, gain if gain is not None else w, bias if bias is not None else w, ws, ss, locks, m, n, k,
        x.stride(0), w.stride(0), out.stride(0), eps, r.cos, r.sin, r.cos.stride(0), r.slots, r.k_cache, r.v_cache,
        PRO=pro, RES=residual is not None, BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, KS=triton.cdiv(triton.cdiv(k, split), bk) * bk,
        PDL=early, ROPE=rope is not None, HQ=r.heads, HKV=r.kv_heads, GLU=glu,
        num_warps=warps, num_stages=stages, **({"launch_pdl": True} if early else {}))
    return out
