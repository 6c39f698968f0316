"""The CUDA backend of paged attention (specialists/ops/attention.py): for static batches (decode and
verify steps, CUDA graphs) in half precision, Triton kernels read each query's keys straight from the
paged pool through the block table: no gathered [B, width] context, no masks, ~12 kernels fewer per
layer. FlashDecoding-style: the keys of a query are split into chunks of CHUNK, one program per
(token, KV head, chunk) keeps a running max, sum and weighted values (fp32), and the last program of
a (token, head) to arrive combines the chunks in chunk order (an arrival counter per (token, head),
as decode_fused's split-K): one kernel per layer, not two. A chunk past the query's keys writes no
partials and the combine reads the chunks with keys only, COMBINE_UNROLL at a time with their loads
in flight together (a loop of one chunk at a time waited on each load: smollm2's 8.25 us a layer at
a 384-token context, 6.86 so; H100, bench/results/attention_combine.jsonl). At batch 1 that is 8 heads x (context /
64) programs instead of 8 (one program per token and head took 17 us per layer at a 400-token
context on an H100).

A query token's result depends only on its own keys, in a fixed order: not on how many tokens its
row verifies (1 or K+1) nor on the static width (chunks past a query's keys add exact zeros), so a
verify computes the attention a plain decode of that token would. Prefills, mixed steps and fp32
models keep the torch path (the CUDA tests of the toys compare eager and static steps in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from specialists.models.batch import ForwardBatch
from specialists.ops.decode_fused import arrival_locks, scratch

__all__ = ["paged_attention_static", "CHUNK"]

CHUNK = 64  # keys per program
COMBINE_UNROLL = 8  # chunks whose partials the combine loads at once


@triton.jit
def _combine(m_ptr, l_ptr, acc_ptr, base, nv, G: tl.constexpr, HD: tl.constexpr, NSPLIT: tl.constexpr,
             BLOCK_Q: tl.constexpr, U: tl.constexpr):
    """The sums of chunks [0, nv) of a (token, KV head) from their partials, in chunk order: groups of U
    chunks unrolled, so that a group's loads are in flight together (a chunk past the keys: masked,
    weight exp(-inf) = 0, exact zeros, as when every chunk's partials were read)."""
    r = tl.arange(0, BLOCK_Q)
    d = tl.arange(0, HD)
    rg = r < G
    m = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    for c0 in range(0, NSPLIT, U):
        for j in tl.static_range(U):
            cm = rg & (c0 + j < nv)
            m = tl.maximum(m, tl.load(m_ptr + base + (c0 + j) * BLOCK_Q + r, mask=cm, other=float("-inf"),
                                      cache_modifier=".cg"))
    l_i = tl.zeros((BLOCK_Q,), tl.float32)
    acc = tl.zeros((BLOCK_Q, HD), tl.float32)
    for c0 in range(0, NSPLIT, U):
        for j in tl.static_range(U):
            cm = rg & (c0 + j < nv)
            row = base + (c0 + j) * BLOCK_Q + r
            w = tl.exp(tl.load(m_ptr + row, mask=cm, other=float("-inf"), cache_modifier=".cg") - m)
            l_i += w * tl.load(l_ptr + row, mask=cm, other=0.0, cache_modifier=".cg")
            acc += w[:, None] * tl.load(acc_ptr + row[:, None] * HD + d[None, :], mask=cm[:, None], other=0.0,
                                        cache_modifier=".cg")
    return l_i, acc


@triton.jit(do_not_specialize=["tokens_per_row", "stride_tab"])
def _attention_kernel(q_ptr, kp_ptr, vp_ptr, tab_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, o_ptr, lock_ptr, stride_tab,
                      tokens_per_row, scale, G: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
                      NSPLIT: tl.constexpr, BLOCK_Q: tl.constexpr, CH: tl.constexpr, U: tl.constexpr,
                      LET_NEXT: tl.constexpr):
    if LET_NEXT:  # the next kernel, a product launched early (decode_fused.launches_early), may launch now
        gdc_launch_dependents()
    t = tl.program_id(0)  # query token
    h = tl.program_id(1)  # KV head: its G query heads are the rows
    s = tl.program_id(2)  # chunk of keys [s * CH, (s + 1) * CH)
    r = tl.arange(0, BLOCK_Q)
    d = tl.arange(0, HD)
    rg = r < G  # the rows that are query heads (BLOCK_Q >= 16 for the dots)
    lim = tl.load(pos_ptr + t) + 1  # causal: keys [0, position]
    n = s * CH + tl.arange(0, CH)
    nm = n < lim
    m_i = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_Q,), tl.float32)
    acc = tl.zeros((BLOCK_Q, HD), tl.float32)
    if s * CH < lim:
        q = tl.load(q_ptr + (t * (HKV * G) + h * G + r[:, None]) * HD + d[None, :], mask=rg[:, None], other=0.0).to(tl.float32)
        b = t // tokens_per_row
        blk = tl.load(tab_ptr + b * stride_tab + n // BS, mask=nm, other=0)
        slot = (blk * BS + n % BS).to(tl.int64)
        kt = tl.load(kp_ptr + (slot[:, None] * HKV + h) * HD + d[None, :], mask=nm[:, None], other=0.0).to(tl.float32)
        vt = tl.load(vp_ptr + (slot[:, None] * HKV + h) * HD + d[None, :], mask=nm[:, None], other=0.0).to(tl.float32)
        sc = tl.dot(q, tl.trans(kt), input_precision="ieee") * scale  # [BLOCK_Q, CH]
        sc = tl.where(nm[None, :], sc, float("-inf"))
        m_i = tl.max(sc, axis=1)
        p = tl.exp(sc - m_i[:, None])
        l_i = tl.sum(p, axis=1)
        acc = tl.dot(p, vt, input_precision="ieee")
    last = True
    if NSPLIT > 1:  # partials out; the last program of (t, h) to arrive combines them, in chunk order
        base = (t * HKV + h) * NSPLIT * BLOCK_Q
        if s * CH < lim:  # a chunk past the keys leaves no partials: the combine reads chunks < nv only
            out = base + s * BLOCK_Q + r
            tl.store(m_ptr + out, m_i, mask=rg)
            tl.store(l_ptr + out, l_i, mask=rg)
            tl.store(acc_ptr + out[:, None] * HD + d[None, :], acc, mask=rg[:, None])
        tl.debug_barrier()
        last = tl.atomic_add(lock_ptr + t * HKV + h, 1, sem="acq_rel") == NSPLIT - 1
        if last:
            l_i, acc = _combine(m_ptr, l_ptr, acc_ptr, base, tl.cdiv(lim, CH), G, HD, NSPLIT, BLOCK_Q, U)
            tl.atomic_xchg(lock_ptr + t * HKV + h, 0)
    if last:  # one chunk: its own sums (the combine of one chunk is exact: weight exp(0) = 1)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + (t * (HKV * G) + h * G + r[:, None]) * HD + d[None, :], o, mask=rg[:, None])


def paged_attention_static(
    q: torch.Tensor,  # [Tp, H_q, D], rows of max_query_len tokens each
    k_cache_layer: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache_layer: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    batch: ForwardBatch,
    scale: float | None = None,
    let_next: bool = False,  # the next kernel launches early (a small o product): let it once every program runs
) -> torch.Tensor:  # [Tp, H_q, D]
    T, H, hd = q.shape
    bs, hkv = k_cache_layer.shape[1], k_cache_layer.shape[2]
    g = H // hkv
    bq = max(16, triton.next_power_of_2(g))
    nsplit = triton.cdiv(batch.max_context_len, CHUNK)  # the static width: a shape of the graph
    parts = T * hkv * nsplit * bq if nsplit > 1 else 1  # one chunk: no partials
    work = scratch(q.device, parts * (hd + 2))  # m, l, acc of every chunk
    m, l_, acc = work[:parts], work[parts:2 * parts], work[2 * parts:].view(parts, hd)
    o = torch.empty_like(q)
    tables = batch.block_tables
    _attention_kernel[(T, hkv, nsplit)](q, k_cache_layer, v_cache_layer, tables, batch.positions, m, l_, acc, o,
                                        arrival_locks(q.device, T * hkv), tables.stride(0), batch.max_query_len,
                                        hd ** -0.5 if scale is None else scale,
                                        G=g, HKV=hkv, HD=hd, BS=bs, NSPLIT=nsplit, BLOCK_Q=bq, CH=CHUNK, U=min(nsplit, COMBINE_UNROLL),
                                        LET_NEXT=let_next)
    return o
