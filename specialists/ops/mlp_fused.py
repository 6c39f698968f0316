"""A Llama MLP step in one kernel on CUDA for models of small width (issue 16): RMSNorm, gate / up,
SiLU * up, down and the residual add, where decode_fused.mma runs it as two products.

At smollm2-135m's size (d 576, ffn 1536) a product streams 1.8-3.5 MB, ~1 us of the device's
bandwidth, while a kernel costs ~5 us: a layer's five kernels take ~29 us of a 0.87 ms token (H100,
session 22). This kernel is one of them instead of two, and h never leaves the chip:

  phase 1  program j (of P = ffn / S <= the SMs) computes S rows of gate and up over the normed rows,
           rounds them and their SiLU * up as the two products' path rounds (decode_fused's module
           docstring), and that slice's share of down: an fp32 partial [M, d] into scratch;
  barrier  an arrival counter: every program is resident (P <= the SM count, one program fits an SM),
           so each waits until all P partials are written;
  phase 2  program j sums the P partials of its outputs [j * C, (j + 1) * C) in one fixed order (a
           sum over a [P, C] tile), adds the bias, rounds, and adds the product to the residual in
           place, as mma's residual store does.

A row's result depends on neither M nor the other rows (the tile shapes and the order of every sum
come from the weights alone), so a verify computes its decodes' MLP bit for bit. Under Triton's
interpreter the programs run one after another and the barrier would wait forever: the two phases
run as two launches there (the same arithmetic). CANTATA_FUSED_MLP=0 keeps the two products.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from specialists.ops.decode_fused import MAX_ROWS, arrival_locks, pdl, scratch

__all__ = ["MlpPlan", "plan", "mlp", "MAX_WIDTH"]

MAX_WIDTH = 1024  # d at most: a program's partial is [M, d] fp32, and P of them go through L2 a call
MAX_PROGRAMS = 128  # phase 2 sums the partials as one [P, C] tile
PDL_BYTES = 16 << 20  # the MLP's weights at most, for the programs to ask L2 for their slices early


class MlpPlan(NamedTuple):
    rows: int  # S: gate / up rows (and down columns) a program
    programs: int  # P
    block_k: int
    block_d: int  # down's outputs a tensor-core tile in phase 1
    cols: int  # C: outputs a program sums in phase 2


_SMS: dict[torch.device, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return MAX_PROGRAMS
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def plan(d: int, ffn: int, device: torch.device) -> MlpPlan | None:
    """How `mlp` splits a [2 * ffn, d] gate / up and a [d, ffn] down on this device, from the shapes
    alone (never from the row count), or None where the two products stay: d above MAX_WIDTH, more
    programs than SMs at 64 rows a program, or CANTATA_FUSED_MLP=0."""
    if d > MAX_WIDTH or os.environ.get("CANTATA_FUSED_MLP", "1") == "0":
        return None
    limit = min(MAX_PROGRAMS, _sm_count(device))
    rows = 16
    while triton.cdiv(ffn, rows) > limit and rows < 64:
        rows *= 2
    programs = triton.cdiv(ffn, rows)
    if programs > limit:
        return None
    block_k = 128 if d % 128 == 0 else 64
    return MlpPlan(rows, programs, block_k, 64, triton.next_power_of_2(triton.cdiv(d, programs)))


@triton.jit
def _prefetch_rows(ptr, rows, mr, stride, n, BLOCK: tl.constexpr):
    """Asks L2 for n columns of each masked row (one prefetch per 128-byte line)."""
    for c0 in range(0, n, BLOCK):
        cols = c0 + tl.arange(0, BLOCK // 64) * 64
        ptrs = tl.where(mr[:, None] & (cols < n)[None, :], ptr + rows[:, None] * stride + cols[None, :], ptr)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_slices(wgu_ptr, wd_ptr, j, ri64, mi, D: tl.constexpr, FFN: tl.constexpr, S: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """Under PDL: lets the next kernel launch, asks L2 for this program's gate, up and down slices while
    the kernel before still runs, then waits for that kernel."""
    gdc_launch_dependents()
    _prefetch_rows(wgu_ptr, ri64, mi, D, D, BLOCK_K)
    _prefetch_rows(wgu_ptr, ri64 + FFN, mi, D, D, BLOCK_K)
    dr = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):  # down's columns of this slice: one line a row
        ptrs = wd_ptr + (d0 + dr).to(tl.int64) * FFN + j * S
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [tl.where(d0 + dr < D, ptrs, wd_ptr)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    gdc_wait()


@triton.jit
def _partials(h_ptr, wgu_ptr, wd_ptr, g_ptr, bgu_ptr, ws_ptr, j, rm, mm, M, stride_h, eps, D: tl.constexpr,
              FFN: tl.constexpr, S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
              BIAS_GU: tl.constexpr, PDL: tl.constexpr):
    """Phase 1: this program's S rows of gate and up, SiLU * up, and its share of down into scratch."""
    dt = wgu_ptr.dtype.element_ty
    ri = j * S + tl.arange(0, S)
    mi = ri < FFN
    ri64 = ri.to(tl.int64)
    if PDL:
        _prefetch_slices(wgu_ptr, wd_ptr, j, ri64, mi, D, FFN, S, BLOCK_K, BLOCK_D)
    hrow = h_ptr + rm.to(tl.int64)[:, None] * stride_h
    acc_g = tl.zeros((S, BLOCK_M), tl.float32)
    acc_u = tl.zeros((S, BLOCK_M), tl.float32)
    ss = tl.zeros((BLOCK_M,), tl.float32)
    for k0 in tl.range(0, D, BLOCK_K):  # pipelined: every block's loads in flight at once (num_stages)
        rk = k0 + tl.arange(0, BLOCK_K)
        mk = rk < D
        xv = tl.load(hrow + rk[None, :], mask=mm[:, None] & mk[None, :], other=0.0).to(tl.float32)
        ss += tl.sum(xv * xv, axis=1)
        a = (xv * tl.load(g_ptr + rk, mask=mk, other=0.0).to(tl.float32)[None, :]).to(dt)
        wmask = mi[:, None] & mk[None, :]
        acc_g = tl.dot(tl.load(wgu_ptr + ri64[:, None] * D + rk[None, :], mask=wmask, other=0.0), tl.trans(a), acc_g)
        acc_u = tl.dot(tl.load(wgu_ptr + (ri64 + FFN)[:, None] * D + rk[None, :], mask=wmask, other=0.0),
                       tl.trans(a), acc_u)
    rs = tl.rsqrt(ss / D + eps)[None, :]
    gate = acc_g * rs
    up = acc_u * rs
    if BIAS_GU:
        gate += tl.load(bgu_ptr + ri, mask=mi, other=0.0).to(tl.float32)[:, None]
        up += tl.load(bgu_ptr + FFN + ri, mask=mi, other=0.0).to(tl.float32)[:, None]
    gate = gate.to(dt).to(tl.float32)  # the products' path stores gate / up in the model's dtype
    act = ((gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up.to(dt).to(tl.float32)).to(dt)  # [S, BLOCK_M]
    for d0 in tl.range(0, D, BLOCK_D):  # pipelined too
        rd = d0 + tl.arange(0, BLOCK_D)
        md = rd < D
        wd = tl.load(wd_ptr + rd.to(tl.int64)[:, None] * FFN + ri64[None, :], mask=md[:, None] & mi[None, :], other=0.0)
        part = tl.dot(wd, act)  # [BLOCK_D, BLOCK_M]
        tl.store(ws_ptr + (j * M + rm[None, :]).to(tl.int64) * D + rd[:, None], part, mask=md[:, None] & mm[None, :])


@triton.jit
def _sums(h_ptr, bd_ptr, ws_ptr, j, M, stride_h, D: tl.constexpr, P: tl.constexpr, BLOCK_M: tl.constexpr,
          C: tl.constexpr, JB: tl.constexpr, RB: tl.constexpr, BIAS_D: tl.constexpr):
    """Phase 2: the P partials of this program's C outputs summed, RB rows at a time (one [JB, RB, C]
    tile, so a row's sum has one order whatever M), the bias, the residual add."""
    dt = h_ptr.dtype.element_ty
    cc = j * C + tl.arange(0, C)
    mc = cc < D
    jj = tl.arange(0, JB)
    rr = tl.arange(0, RB)
    for r0 in tl.static_range(0, BLOCK_M, RB):  # (not a loop to M: the interpreter cannot take M as a bound)
        if r0 < M:
            rows = r0 + rr
            mr = (rows < M)[:, None] & mc[None, :]
            tile = tl.load(ws_ptr + ((jj[:, None, None] * M + rows[None, :, None]).to(tl.int64) * D + cc[None, None, :]),
                           mask=(jj < P)[:, None, None] & mr[None, :, :], other=0.0, cache_modifier=".cg")
            acc = tl.sum(tile, axis=0)  # [RB, C]
            if BIAS_D:
                acc += tl.load(bd_ptr + cc, mask=mc, other=0.0).to(tl.float32)[None, :]
            optr = h_ptr + rows[:, None] * stride_h + cc[None, :]
            y = (tl.load(optr, mask=mr, other=0.0).to(tl.float32) + acc.to(dt).to(tl.float32)).to(dt)
            tl.store(optr, y, mask=mr)


@triton.jit(do_not_specialize=["M", "stride_h"])
def _mlp_kernel(h_ptr, wgu_ptr, wd_ptr, g_ptr, bgu_ptr, bd_ptr, ws_ptr, lock_ptr, M, stride_h, eps,
                D: tl.constexpr, FFN: tl.constexpr, S: tl.constexpr, P: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, C: tl.constexpr, JB: tl.constexpr, RB: tl.constexpr,
                BIAS_GU: tl.constexpr, BIAS_D: tl.constexpr, PDL: tl.constexpr, PHASE: tl.constexpr):
    """PHASE 0: both phases with the barrier between them (CUDA); 1 or 2: that phase alone."""
    j = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    if PHASE != 2:
        _partials(h_ptr, wgu_ptr, wd_ptr, g_ptr, bgu_ptr, ws_ptr, j, rm, rm < M, M, stride_h, eps, D, FFN, S, BLOCK_M,
                  BLOCK_K, BLOCK_D, BIAS_GU, PDL)
    if PHASE == 0:  # every partial written (P programs, all resident) before any is summed
        tl.debug_barrier()
        seen = tl.atomic_add(lock_ptr, 1, sem="acq_rel") + 1
        while seen < P:
            seen = tl.atomic_add(lock_ptr, 0, sem="acquire")
    if PHASE != 1:
        _sums(h_ptr, bd_ptr, ws_ptr, j, M, stride_h, D, P, BLOCK_M, C, JB, RB, BIAS_D)
    if PHASE == 0:  # the last to leave resets both counters (nobody reads them after)
        tl.debug_barrier()
        if tl.atomic_add(lock_ptr + 1, 1, sem="acq_rel") == P - 1:
            tl.atomic_xchg(lock_ptr, 0)
            tl.atomic_xchg(lock_ptr + 1, 0)


def mlp(h: torch.Tensor, gain: torch.Tensor, eps: float, gate_up: torch.Tensor, down: torch.Tensor,
        gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
        mplan: MlpPlan | None = None, two_launches: bool = False) -> torch.Tensor:
    """h += down(silu(gate) * up) over rms_norm(h) * gain, in place, for M <= MAX_ROWS rows h [M, d],
    gate_up [2 * ffn, d] (gate rows first), down [d, ffn]. Returns h. two_launches: the phases as two
    kernels without the barrier (as under the interpreter; the same bits; for measuring the barrier)."""
    m, d = h.shape
    ffn = down.shape[1]
    p = mplan or plan(d, ffn, h.device)
    if p is None:
        raise ValueError(f"no fused MLP for d {d}, ffn {ffn} on {h.device}")
    if m > MAX_ROWS or h.stride(-1) != 1 or gate_up.shape != (2 * ffn, d) or down.shape != (d, ffn):
        raise ValueError(f"fused MLP wants at most {MAX_ROWS} row-major rows: h {tuple(h.shape)}, "
                         f"gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}")
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("fused MLP wants contiguous weights")
    ws = scratch(h.device, p.programs * m * d)
    locks = arrival_locks(h.device, 2)
    early = pdl(h.device) and (gate_up.numel() + down.numel()) * gate_up.element_size() <= PDL_BYTES
    bm = max(16, triton.next_power_of_2(m))
    stages = max(2, min(triton.cdiv(d, p.block_k), 200_000 // ((2 * p.rows + bm) * p.block_k * h.element_size())))
    phases = (1, 2) if two_launches or os.environ.get("TRITON_INTERPRET") == "1" else (0,)
    for phase in phases:
        _mlp_kernel[(p.programs,)](
            h, gate_up, down, gain, gain if gate_up_bias is None else gate_up_bias, gain if down_bias is None else down_bias, ws, locks, m, h.stride(0),
            eps, D=d, FFN=ffn, S=p.rows, P=p.programs, BLOCK_M=bm, BLOCK_K=p.block_k,
            BLOCK_D=p.block_d, C=p.cols, JB=triton.next_power_of_2(p.programs), RB=8, BIAS_GU=gate_up_bias is not None, BIAS_D=down_bias is not None, PDL=early and phase == 0,
            PHASE=phase, num_warps=4, num_stages=stages, **({"launch_pdl": True} if early and phase == 0 else {}))
    return h
