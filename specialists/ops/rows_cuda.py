"""Per-token work of a CUDA graph step in one kernel each, where torch took several.

* `row_argmax(x)`: [n, V] -> [n] int64, torch.argmax(x, -1)'s answer (the first index of the row's
  largest value; a NaN counts as the largest, the first NaN wins). torch reduces a row in one block
  of threads: 12.9 us a token at smollm2's 49,152 logits on an H100, plus a copy to fp32 before it.
  Here one program per BLOCK columns of a row finds its block's largest value and first index, and
  the last program of the row to arrive (an arrival counter, as decode_fused's split-K) picks, among
  the blocks holding the row's largest value, the smallest index: the same answer whatever order
  the blocks ran in. Half and fp32 rows alike (a half value converts to fp32 exactly).
* `step_rows(positions, context_lens, tables, j, block_size)`: a multi-step graph's step j batch
  (specialists/multistep.py): positions + j, the KV slots through the block tables, contexts + j;
  one kernel instead of six torch ops a token.
* `advance_rows(...)`: a verify launched ahead (spec/verify_ahead.py) moved on the device past what the
  verify before it keeps (specialists/staging.advance_rows): one kernel instead of ~13 torch ops, each
  ~10-15 us of the host's launch time on an H200 (the toys' speculative steps are host-bound there).

Elsewhere (CPU, no Triton) row_argmax and step_rows are their torch expressions; advance_rows' are in
specialists/staging.advance_rows.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU install: the torch expressions below
    triton = None

__all__ = ["advance_rows", "row_argmax", "step_rows"]

BLOCK = 2048  # columns per program of row_argmax


def _fast(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


if triton is not None:
    from specialists.ops.decode_fused import arrival_locks

    @triton.jit
    def _argmax_kernel(x_ptr, stride_x, v_ptr, i_ptr, n_ptr, out_ptr, lock_ptr, V, NB: tl.constexpr, NBP: tl.constexpr,
                       BLOCK_V: tl.constexpr):
        row = tl.program_id(0)
        blk = tl.program_id(1)
        cols = blk * BLOCK_V + tl.arange(0, BLOCK_V)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        nan = x != x
        big = 1 << 30
        has_nan = tl.max(nan.to(tl.int32), axis=0)
        first_nan = tl.min(tl.where(nan, cols, big), axis=0)
        best = tl.max(tl.where(nan, float("-inf"), x), axis=0)
        first = tl.min(tl.where(x == best, cols, big), axis=0)
        part = row * NB + blk
        tl.store(v_ptr + part, best)
        tl.store(i_ptr + part, tl.where(has_nan > 0, first_nan, first))
        tl.store(n_ptr + part, has_nan)
        tl.debug_barrier()
        if tl.atomic_add(lock_ptr + row, 1, sem="acq_rel") == NB - 1:  # the row's last block: its answer
            b = tl.arange(0, NBP)
            ok = b < NB
            v = tl.load(v_ptr + row * NB + b, mask=ok, other=float("-inf"), cache_modifier=".cg")
            i = tl.load(i_ptr + row * NB + b, mask=ok, other=big, cache_modifier=".cg")
            f = tl.load(n_ptr + row * NB + b, mask=ok, other=0, cache_modifier=".cg")
            any_nan = tl.max(f, axis=0) > 0
            top = tl.max(v, axis=0)
            pick = tl.where(any_nan, f > 0, v == top) & ok
            tl.store(out_ptr + row, tl.min(tl.where(pick, i, big), axis=0).to(tl.int64))
            tl.atomic_xchg(lock_ptr + row, 0)

    @triton.jit
    def _step_rows_kernel(pos_ptr, ctx_ptr, tab_ptr, stride_tab, pos_out, slot_out, ctx_out, B, j,
                          BS: tl.constexpr, BLOCK_B: tl.constexpr):
        b = tl.arange(0, BLOCK_B)
        ok = b < B
        pos = tl.load(pos_ptr + b, mask=ok, other=0) + j
        blk = tl.load(tab_ptr + b * stride_tab + pos // BS, mask=ok, other=0).to(tl.int64)
        tl.store(pos_out + b, pos, mask=ok)
        tl.store(slot_out + b, blk * BS + pos % BS, mask=ok)
        tl.store(ctx_out + b, tl.load(ctx_ptr + b, mask=ok, other=0) + j, mask=ok)

    @triton.jit
    def _advance_kernel(ids_ptr, pos_ptr, slot_ptr, ctx_ptr, tab_ptr, stride_tab, packed_ptr, stride_packed,
                        drafts_ptr, stride_drafts, Q, BS: tl.constexpr, BLOCK_Q: tl.constexpr):
        b = tl.program_id(0)  # one program a real row: its Q tokens
        j = tl.arange(0, BLOCK_Q)
        ok = j < Q
        step = tl.load(packed_ptr + b * stride_packed) + 1  # the kept drafts and the fed token
        target = tl.load(packed_ptr + b * stride_packed + step)  # the verify's token after them
        draft = tl.load(drafts_ptr + b * stride_drafts + j - 1, mask=ok & (j > 0), other=0)
        tl.store(ids_ptr + b * Q + j, tl.where(j == 0, target, draft), mask=ok)
        pos = tl.load(pos_ptr + b * Q + j, mask=ok, other=0) + step
        tl.store(pos_ptr + b * Q + j, pos, mask=ok)
        blk = tl.load(tab_ptr + b * stride_tab + pos // BS, mask=ok, other=0).to(tl.int64)
        tl.store(slot_ptr + b * Q + j, blk * BS + pos % BS, mask=ok)
        tl.store(ctx_ptr + b, tl.load(ctx_ptr + b) + step)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """[n, V] -> [n] int64: the first index of each row's largest value (torch.argmax(x, -1))."""
    if not _fast(x) or x.dim() != 2 or x.stride(1) != 1:
        return x.argmax(-1)
    return _argmax(x)


def _argmax(x: torch.Tensor) -> torch.Tensor:  # the kernel (tests run it on CPU tensors under TRITON_INTERPRET=1)
    n, V = x.shape
    nb = triton.cdiv(V, BLOCK)
    vals = torch.empty(n * nb, dtype=torch.float32, device=x.device)
    idx = torch.empty(n * nb, dtype=torch.int32, device=x.device)
    nans = torch.empty(n * nb, dtype=torch.int32, device=x.device)
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    _argmax_kernel[(n, nb)](x, x.stride(0), vals, idx, nans, out, arrival_locks(x.device, n), V, NB=nb,
                            NBP=triton.next_power_of_2(nb), BLOCK_V=BLOCK)
    return out


def step_rows(positions: torch.Tensor, context_lens: torch.Tensor, tables: torch.Tensor, j: int,
              block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (positions + j, slots of those positions through the block tables [int64], context_lens + j)."""
    if not _fast(positions) or tables.stride(1) != 1:
        pos = positions + j
        blocks = tables.gather(1, (pos // block_size)[:, None]).squeeze(1).long()
        return pos, blocks * block_size + pos % block_size, context_lens + j
    return _step_rows(positions, context_lens, tables, j, block_size)


def _step_rows(positions: torch.Tensor, context_lens: torch.Tensor, tables: torch.Tensor, j: int,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # the kernel
    B = positions.shape[0]
    pos, ctx = torch.empty_like(positions), torch.empty_like(context_lens)
    slots = torch.empty(B, dtype=torch.int64, device=positions.device)
    _step_rows_kernel[(1,)](positions, context_lens, tables, tables.stride(0), pos, slots, ctx, B, j,
                            BS=block_size, BLOCK_B=max(16, triton.next_power_of_2(B)))
    return pos, slots, ctx


def advance_rows(ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, context_lens: torch.Tensor,
                 tables: torch.Tensor, packed: torch.Tensor, drafts: torch.Tensor, B: int, q: int, block_size: int) -> None:
    """In place, rows b < B of a static batch of q tokens a row (flat ids, positions and slots, row b's at
    b * q; contexts [Bp]; tables [Bp, width]): each row starts packed[b, 0] + 1 positions later, fed
    packed[b, packed[b, 0] + 1] then drafts[b, :q-1]; slots through the tables; contexts grow alike."""
    _advance_kernel[(B,)](ids, positions, slots, context_lens, tables, tables.stride(0), packed, packed.stride(0),
                          drafts, drafts.stride(0), q, BS=block_size, BLOCK_Q=max(2, triton.next_power_of_2(q)))


def fused_advance(*tensors: torch.Tensor) -> bool:
    """Whether advance_rows runs as the kernel on these tensors (CUDA with Triton, unit last strides: the
    kernel reads the flat fields at b * q + j and the tables, packed rows and drafts by their row strides)."""
    return triton is not None and all(t.is_cuda and t.stride(-1) == 1 for t in tensors)
