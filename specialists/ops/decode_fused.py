"""The target's decode and verify steps on CUDA in half precision, with fewer kernels (issue 16).

A Llama layer's step at a few rows was 15 kernels on torch ops: two RMSNorms (torch's kernel costs
~3 us at d = 2048 and one row), two residual adds, SiLU and its product, and the products as cuBLAS
GEMMs (at one row 1.4-2.6 TB/s, some split-K with a reduction kernel). At real sizes the gaps between
kernels and the small kernels' fixed cost held a 1B model at 2.3x its bandwidth bound. Two paths:

  gemv (one sequence, at most GEMV_ROWS rows: batch 1's decodes and verifies): four products per
      layer, each a Triton kernel that streams its weight rows over the whole K and carries its
      neighbours: RMSNorm before q/k/v and gate/up, SiLU * up before down, the residual add after o
      and down (in place). A layer is 7 kernels with RoPE + KV write and the two attention kernels.
      Rows run the same instructions whatever their number or slot, so a verify of K+1 tokens
      computes exactly what the decodes of those tokens compute (the exactness contract).
  gemm (more sequences, at most MAX_ROWS rows): cuBLAS products, with rms_norm and silu_mul as one
      Triton kernel each and the residual as the GEMM's C operand (add_product: no add kernel).

The rounding follows the torch ops replaced: the normed input, the SiLU and its product are rounded
to the model's dtype before a product; products accumulate in fp32 and are rounded before the
residual add. The gemv's cost: a verify of 4 rows streams the weights once but multiplies them into
four accumulators, 1.6-2x a one-row product (bench/RESULTS.md). Prefills keep the torch ops. With
TRITON_INTERPRET=1 the kernels run on CPU tensors (tests). CANTATA_FUSED_DECODE=0 turns both paths off
(A/B runs).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from specialists.ops.attention import HALF

__all__ = ["enabled", "rms_norm", "silu_mul", "add_product", "gemv", "gemv_config", "MAX_ROWS", "GEMV_ROWS"]

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


GEMV_ROWS = 8  # a step of one sequence with at most this many rows (a decode, a verify of K+1) uses `gemv`
ROWS = 4  # rows per gemv launch at most (5..8 rows take two launches)


def gemv_config(prologue: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of `gemv` by its prologue (0 none, 1 RMSNorm, 2 SiLU * up): the
    configurations with the least time at one row plus four rows at llama-1b's and llama-3b's shapes
    (bench.fused_products --sweep, H100, bench/results/fused_products.jsonl). 8 output rows per
    program spread a 2048-row weight over ~2 programs per SM without splitting K; tiles of at most
    4096 weights keep four rows' accumulators in registers (a 16 x 1024 tile spilled: 4x the time).
    A narrow product (k <= 1024, SmolLM2's) takes blocks of 256 columns (no mostly-masked last block)."""
    if prologue == 0 and k <= 1024:
        return 8, 256, 4
    return ((8, 512, 4), (8, 256, 4), (8, 512, 8))[prologue]


@triton.jit
def _mean_square_scale(xrow, K: tl.constexpr, BLOCK_K: tl.constexpr, eps):
    """rsqrt(mean(x^2) + eps) of one row (a few KB: L2)."""
    ss = tl.zeros((BLOCK_K,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(xrow + rk, mask=rk < K, other=0.0).to(tl.float32)
        ss += xv * xv
    return tl.rsqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def _operand(xrow, g_ptr, rk, mk, rs, K: tl.constexpr, PRO: tl.constexpr, dt: tl.constexpr):
    """Columns rk of one row's product input, fp32: x, rms_norm(x) * g (PRO 1, rs its scale) or
    silu(gate) * up (PRO 2), each rounded to the model's dtype as the torch ops round."""
    if PRO == 2:
        gate = tl.load(xrow + rk, mask=mk, other=0.0).to(tl.float32)
        up = tl.load(xrow + K + rk, mask=mk, other=0.0).to(tl.float32)
        a = ((gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up).to(dt)
    elif PRO == 1:
        xv = tl.load(xrow + rk, mask=mk, other=0.0).to(tl.float32)
        a = (xv * rs * tl.load(g_ptr + rk, mask=mk, other=0.0).to(tl.float32)).to(dt)
    else:
        a = tl.load(xrow + rk, mask=mk, other=0.0)
    return a.to(tl.float32)


@triton.jit
def _finish(acc, optr, mn, RES: tl.constexpr, dt: tl.constexpr):
    y = tl.sum(acc, axis=1).to(dt)
    if RES:
        y = (tl.load(optr, mask=mn, other=0.0).to(tl.float32) + y.to(tl.float32)).to(dt)
    tl.store(optr, y, mask=mn)


@triton.jit(do_not_specialize=["N"])
def _gemv_kernel(x_ptr, w_ptr, out_ptr, g_ptr, N, K: tl.constexpr, stride_x, stride_w, stride_out, eps,
                 PRO: tl.constexpr, RES: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """One program per BLOCK_N outputs streams its weight rows over the whole K once and multiplies
    each tile into ROWS (1..4) rows, one accumulator each, every row with the same instructions: a
    row's result depends on neither ROWS nor its slot (a verify computes its decodes' products)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = rn < N
    dt = w_ptr.dtype.element_ty
    wrow = w_ptr + rn.to(tl.int64)[:, None] * stride_w
    x1, x2, x3 = x_ptr + stride_x, x_ptr + 2 * stride_x, x_ptr + 3 * stride_x
    rs0 = 1.0
    rs1 = 1.0
    rs2 = 1.0
    rs3 = 1.0
    if PRO == 1:
        rs0 = _mean_square_scale(x_ptr, K, BLOCK_K, eps)
        if ROWS > 1:
            rs1 = _mean_square_scale(x1, K, BLOCK_K, eps)
        if ROWS > 2:
            rs2 = _mean_square_scale(x2, K, BLOCK_K, eps)
        if ROWS > 3:
            rs3 = _mean_square_scale(x3, K, BLOCK_K, eps)
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mk = rk < K
        w = tl.load(wrow + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.0).to(tl.float32)
        acc0 += w * _operand(x_ptr, g_ptr, rk, mk, rs0, K, PRO, dt)[None, :]
        if ROWS > 1:
            acc1 += w * _operand(x1, g_ptr, rk, mk, rs1, K, PRO, dt)[None, :]
        if ROWS > 2:
            acc2 += w * _operand(x2, g_ptr, rk, mk, rs2, K, PRO, dt)[None, :]
        if ROWS > 3:
            acc3 += w * _operand(x3, g_ptr, rk, mk, rs3, K, PRO, dt)[None, :]
    _finish(acc0, out_ptr + rn, mn, RES, dt)
    if ROWS > 1:
        _finish(acc1, out_ptr + stride_out + rn, mn, RES, dt)
    if ROWS > 2:
        _finish(acc2, out_ptr + 2 * stride_out + rn, mn, RES, dt)
    if ROWS > 3:
        _finish(acc3, out_ptr + 3 * stride_out + rn, mn, RES, dt)


def gemv(x: torch.Tensor, w: torch.Tensor, *, gain: torch.Tensor | None = None, eps: float = 0.0,
         swiglu: bool = False, residual: torch.Tensor | None = None,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Weight products of a few rows (at most GEMV_ROWS): one program per BLOCK_N outputs streams its
    weight rows over the whole K (no split-K, no reduction kernel), up to ROWS rows a launch, with the
    neighbours carried: x [M, K] (gain given: rms_norm(x) * gain; swiglu: x = [gate | up] [M, 2K] ->
    silu(gate) * up) -> W @ a [M, N]; with `residual` [M, N] the result is added to it in place (and
    it is returned). A row's result does not depend on the other rows (a verify computes its decodes'
    products, bit for bit)."""
    m = x.shape[0]
    n, k = w.shape
    if m > GEMV_ROWS:
        raise ValueError(f"gemv takes at most {GEMV_ROWS} rows, got {m}")
    if x.stride(-1) != 1 or w.stride(-1) != 1 or x.shape[1] != (2 * k if swiglu else k):
        raise ValueError(f"gemv wants row-major operands: x {tuple(x.shape)}, w {tuple(w.shape)}")
    out = residual if residual is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    pro = 2 if swiglu else (1 if gain is not None else 0)
    bn, bk, warps = config or gemv_config(pro, k)
    for r0 in range(0, m, ROWS):
        _gemv_kernel[(triton.cdiv(n, bn),)](
            x[r0:], w, out[r0:], gain if gain is not None else w, n, k, x.stride(0), w.stride(0), out.stride(0), eps,
            PRO=pro, RES=residual is not None,
            ROWS=min(ROWS, m - r0), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return out
