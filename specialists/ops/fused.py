"""Triton kernels for the drafter's layer on a GPU: a drafting step in 8 kernels instead of ~31.

On an H100 a kernel of these models' sizes (d = 256) costs ~2 us whatever it does, so a drafter layer
built from torch ops (RMSNorm, product, RoPE's rolls and products, K/V scatter, a gathered context,
grouped products, softmax, SwiGLU, residual adds, ...) costs ~75 us per draft, the same as two thirds
of a target decode. Here each product carries its neighbours:

  rows_linear  out = [silu](W' @ unit(x)) [* W'' @ unit(x)] [+ residual] [+ table[token]]
               (unit = RMSNorm without its gain, which the drafter folds into W; optional)
  qkv_rope     q, k, v = W_qkv @ unit(x), q and k rotated, k and v written to the paged pool
  paged_attention  each query over its sequence's pool entries [0, limit), through the block table

Products accumulate in fp32.

Every kernel is compiled per weight shape and context width only (row counts, chain depths and
tokens per row are not specialized on), so a step of a new length (the last, shorter chains of a
request near max_tokens) replays or captures without compiling. Used by specialists/drafter.py for the chain and the rebuild of static batches (CUDA graphs); the
eager and CPU paths keep the torch ops. With TRITON_INTERPRET=1 (set before this module is imported)
the kernels run on CPU tensors through Triton's interpreter, which is how CI tests them.
"""

from __future__ import annotations

import triton
import triton.language as tl
import torch

__all__ = ["rows_linear", "qkv_rope", "paged_attention"]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit
def _x_chunk(x_ptr, rm, mm, stride_x, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns [k0, k0 + BLOCK_K) of rows rm of x, as fp32 (and the column ids and mask)."""
    rk = k0 + tl.arange(0, BLOCK_K)
    mk = rk < K
    x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mm[:, None] & mk[None, :], other=0.0).to(tl.float32)
    return rk, mk, x


@triton.jit
def _w_dot(w_ptr, wrows, wmask, stride_w, rk, mk, x):
    """x [BM, BK] times rows wrows of w over the same columns -> [BM, len(wrows)] partial products."""
    w = tl.load(w_ptr + wrows[:, None] * stride_w + rk[None, :], mask=wmask[:, None] & mk[None, :], other=0.0).to(tl.float32)
    return tl.sum(x[:, None, :] * w[None, :, :], axis=2)


@triton.jit(do_not_specialize=["M"])  # one compile for any row count
def _rows_linear_kernel(x_ptr, w_ptr, out_ptr, res_ptr, tok_ptr, tab_ptr, M, N, K: tl.constexpr,
                        stride_x, stride_w, stride_out, stride_res, stride_tab, eps,
                        NORM: tl.constexpr, RES: tl.constexpr, GATHER: tl.constexpr, SILU_MUL: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, mn = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    ss = tl.zeros((BLOCK_M,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk, mk, x = _x_chunk(x_ptr, rm, mm, stride_x, k0, K, BLOCK_K)
        acc += _w_dot(w_ptr, rn, mn, stride_w, rk, mk, x)
        if SILU_MUL:  # the up half: rows N.. of W
            acc2 += _w_dot(w_ptr, rn + N, mn, stride_w, rk, mk, x)
        if NORM:
            ss += tl.sum(x * x, axis=1)
    if NORM:
        rs = 1.0 / tl.sqrt(ss / K + eps)
        acc = acc * rs[:, None]
        acc2 = acc2 * rs[:, None]
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    omask = mm[:, None] & mn[None, :]
    if RES:
        acc += tl.load(res_ptr + rm[:, None] * stride_res + rn[None, :], mask=omask, other=0.0).to(tl.float32)
    if GATHER:
        t = tl.maximum(tl.load(tok_ptr + rm, mask=mm, other=0), 0)  # -1 (no token) reads row 0
        acc += tl.load(tab_ptr + t[:, None] * stride_tab + rn[None, :], mask=omask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rm[:, None] * stride_out + rn[None, :], acc, mask=omask)


def rows_linear(x: torch.Tensor, w: torch.Tensor, *, norm_eps: float | None = None, residual: torch.Tensor | None = None,
                tokens: torch.Tensor | None = None, table: torch.Tensor | None = None, silu_mul: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N]: W @ unit(x) (norm_eps given: unit = RMSNorm without a gain) for w [N, K],
    or silu(W[:N] @ u) * (W[N:] @ u) for w [2N, K] (silu_mul), plus residual [M, N] and table[tokens]
    (table [V, N], tokens [M]) when given."""
    M, K = x.shape
    N = w.shape[0] // 2 if silu_mul else w.shape[0]
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("rows_linear wants row-major x and w")
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bm = min(_pow2(M), 4)
    bn = 32
    dummy = out
    _rows_linear_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x, w, out, residual if residual is not None else dummy, tokens if tokens is not None else dummy,
        table if table is not None else dummy, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0, table.stride(0) if table is not None else 0,
        0.0 if norm_eps is None else norm_eps,
        NORM=norm_eps is not None, RES=residual is not None, GATHER=tokens is not None, SILU_MUL=silu_mul,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64)
    return out


@triton.jit(do_not_specialize=["M", "pos_add", "entry_add"])
def _qkv_rope_kernel(x_ptr, w_ptr, q_ptr, kp_ptr, vp_ptr, cs_ptr, pos_ptr, slot_ptr, tab_ptr,
                     M, K: tl.constexpr, stride_x, stride_w, stride_tab, pos_add, entry_add, eps,
                     HQ: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
                     FROM_TABLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1)  # output head: q heads, then k heads, then v heads
    mm = rm < M
    j = tl.arange(0, HD)
    partner = (j + HD // 2) % HD  # rotate-half: roll(x, HD/2)[j] = x[partner[j]]
    acc = tl.zeros((BLOCK_M, HD), tl.float32)
    acc_p = tl.zeros((BLOCK_M, HD), tl.float32)
    ss = tl.zeros((BLOCK_M,), tl.float32)
    allj = j < HD
    for k0 in range(0, K, BLOCK_K):
        rk, mk, x = _x_chunk(x_ptr, rm, mm, stride_x, k0, K, BLOCK_K)
        acc += _w_dot(w_ptr, h * HD + j, allj, stride_w, rk, mk, x)
        if h < HQ + HKV:
            acc_p += _w_dot(w_ptr, h * HD + partner, allj, stride_w, rk, mk, x)
        ss += tl.sum(x * x, axis=1)
    rs = 1.0 / tl.sqrt(ss / K + eps)
    acc = acc * rs[:, None]
    acc_p = acc_p * rs[:, None]
    if FROM_TABLE:  # chained entries: index = c + entry_add in the row's block table, rope position index + 1
        e = tl.load(pos_ptr + rm, mask=mm, other=0) + entry_add
        pos = e + 1
        blk = tl.load(tab_ptr + rm * stride_tab + e // BS, mask=mm, other=0)
        slot = blk * BS + e % BS
    else:
        pos = tl.load(pos_ptr + rm, mask=mm, other=0) + pos_add
        slot = tl.load(slot_ptr + rm, mask=mm, other=0)
    if h < HQ + HKV:  # cs [P, 2, 1, HD]: cos, then sin with the rotate-half sign folded in
        cos = tl.load(cs_ptr + pos[:, None] * (2 * HD) + j[None, :], mask=mm[:, None], other=0.0).to(tl.float32)
        sin = tl.load(cs_ptr + pos[:, None] * (2 * HD) + HD + j[None, :], mask=mm[:, None], other=0.0).to(tl.float32)
        acc = acc * cos + acc_p * sin
    if h < HQ:
        tl.store(q_ptr + (rm[:, None] * HQ + h) * HD + j[None, :], acc, mask=mm[:, None])
    elif h < HQ + HKV:
        tl.store(kp_ptr + (slot[:, None] * HKV + (h - HQ)) * HD + j[None, :], acc, mask=mm[:, None])
    else:
        tl.store(vp_ptr + (slot[:, None] * HKV + (h - HQ - HKV)) * HD + j[None, :], acc, mask=mm[:, None])


def qkv_rope(x: torch.Tensor, w: torch.Tensor, cs: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             num_heads: int, num_kv_heads: int, eps: float, *, positions: torch.Tensor | None = None,
             pos_add: int = 0, slots: torch.Tensor | None = None, committed: torch.Tensor | None = None,
             tables: torch.Tensor | None = None, entry_add: int = 0, q_out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, d] -> q [M, H, hd]; k and v written to the pool [blocks, bs, H_kv, hd]. W_qkv [(H + 2 H_kv) hd, d]
    reads unit(x); q and k are rotated with cs [P, 2, 1, hd] (cos, signed sin) at their positions.
    Either positions [M] (+ pos_add) and pool slots [M], or (a chain's entry) committed [M], tables
    [M, W] and entry_add: entry e = committed + entry_add at position e + 1, slot through the table."""
    M, K = x.shape
    hd = k_pool.shape[-1]
    bs = k_pool.shape[1]
    q = q_out if q_out is not None else torch.empty(M, num_heads, hd, dtype=x.dtype, device=x.device)
    from_table = committed is not None
    bm = min(_pow2(M), 4)
    _qkv_rope_kernel[(triton.cdiv(M, bm), num_heads + 2 * num_kv_heads)](
        x, w, q, k_pool, v_pool, cs, committed if from_table else positions, slots if slots is not None else x,
        tables if from_table else x, M, K, x.stride(0), w.stride(0), tables.stride(0) if from_table else 0,
        pos_add, entry_add, eps, HQ=num_heads, HKV=num_kv_heads, HD=hd, BS=bs, FROM_TABLE=from_table,
        BLOCK_M=bm, BLOCK_K=64)
    return q


@triton.jit(do_not_specialize=["tokens_per_row", "lim_add"])
def _paged_attention_kernel(q_ptr, kp_ptr, vp_ptr, tab_ptr, lim_ptr, o_ptr, stride_tab, tokens_per_row, lim_add, scale,
                            G: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
                            MAX_N: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)  # one query token: its G query heads of kv head h
    h = tl.program_id(1)
    b = t // tokens_per_row
    r = tl.arange(0, BLOCK_Q)
    rv = r < G
    head = h * G + r
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (t * (HKV * G) + head[:, None]) * HD + d[None, :], mask=rv[:, None], other=0.0).to(tl.float32)
    lim = tl.load(lim_ptr + t) + lim_add  # keys [0, lim)
    m_i = tl.full((BLOCK_Q,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_Q,), tl.float32)
    acc = tl.zeros((BLOCK_Q, HD), tl.float32)
    for n0 in range(0, MAX_N, BLOCK_N):  # MAX_N: the call's width (a loop bound the interpreter can take)
        if n0 < lim:
            n = n0 + tl.arange(0, BLOCK_N)
            nm = n < lim
            blk = tl.load(tab_ptr + b * stride_tab + n // BS, mask=nm, other=0)
            slot = blk * BS + n % BS
            kt = tl.load(kp_ptr + (slot[:, None] * HKV + h) * HD + d[None, :], mask=nm[:, None], other=0.0).to(tl.float32)
            vt = tl.load(vp_ptr + (slot[:, None] * HKV + h) * HD + d[None, :], mask=nm[:, None], other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(kt), input_precision="ieee") * scale  # [BLOCK_Q, BLOCK_N]
            s = tl.where(nm[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
            m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (t * (HKV * G) + head[:, None]) * HD + d[None, :], out, mask=rv[:, None])


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                    limits: torch.Tensor, limit_add: int, scale: float, tokens_per_row: int, max_keys: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B * tokens_per_row, H, hd] (row b's tokens consecutive) -> [B * tokens_per_row, H, hd]: each
    query token t over the pool entries [0, limits[t] + limit_add) of its row's block table
    (tables [B, W] int64), at most max_keys keys. Causal attention is limits = positions, limit_add = 1.
    One program per (token, kv head); the kernel is compiled per max_keys (rounded up to 64 keys) and
    nothing else of the call, so a chain or verify of another length reuses it."""
    T, H, hd = q.shape
    hkv, bs = k_pool.shape[2], k_pool.shape[1]
    o = out if out is not None else torch.empty_like(q)
    g = H // hkv
    _paged_attention_kernel[(T, hkv)](
        q, k_pool, v_pool, tables, limits, o, tables.stride(0), tokens_per_row, limit_add, scale,
        G=g, HKV=hkv, HD=hd, BS=bs, MAX_N=-(-max_keys // 64) * 64, BLOCK_Q=max(16, _pow2(g)), BLOCK_N=32)
    return o
