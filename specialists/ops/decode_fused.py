"""The target's decode and verify steps on CUDA in half precision, with fewer kernels (issue 16).

A Llama layer's step at a few rows was 15 kernels on torch ops: two RMSNorms (torch's kernel costs
~3.6 us at d = 2048 and one row), two residual adds, SiLU and its product, and the products, some as
cuBLAS split-K GEMMs with their reduction kernels. At real sizes the gaps between kernels and the small
kernels' fixed cost held a 1B model at 2.3x its bandwidth bound. Here:

  rms_norm     one Triton program per row (fp32 math, rounded once, as torch's fused kernel)
  silu_mul     silu(gate) * up in one kernel, with torch's two roundings
  add_product  h += x @ W^T in place: the residual is the GEMM's C operand (beta = 1), no add kernel

so a layer is 11-12 kernels with the q/k/v product, RoPE + KV write and the two attention kernels.
A Triton product that carried the norm, SiLU and residual in one kernel (a layer in 7) was tried and
measured slower than cuBLAS at every shape but the small ones (bench/RESULTS.md, issue 16).

Used for steps of 1..MAX_ROWS rows (decodes and verifies); prefills keep the torch ops. With
TRITON_INTERPRET=1 the kernels run on CPU tensors (tests). CANTATA_FUSED_DECODE=0 turns this path off
(A/B runs).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["enabled", "rms_norm", "silu_mul", "add_product", "MAX_ROWS"]

MAX_ROWS = 64  # decodes and verifies (prefills keep the torch ops)
HALF = (torch.bfloat16, torch.float16)


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
