"""The runner's static input buffers (specialists/runner.py): every index tensor of a batch is a view
into one int64 buffer allocated once and grown only when a step needs more room; the host fills a
staging copy and the device gets it in one copy (on CPU the staging buffer is the device buffer);
`stage_rows` writes a step's rows into the staging copy, `place_drafts` a verify's drafts on the device."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from specialists.ops.attention import HALF
from specialists.ops.rows_cuda import advance_rows as rows_advance
from specialists.ops.rows_cuda import fused_advance
from state.kv_cache import flat_slots
from state.transfer import device_ints


@dataclass
class Layout:
    """The shape of a built batch (specialists/runner.py): real rows B of T tokens, padded to Bp rows of Tp tokens."""

    B: int
    T: int
    Bp: int
    Tp: int
    q_pad: int  # tokens per padding row
    width: int  # block table width
    static: bool
    uniform: bool = False  # no prefill, every row q_pad tokens


class StaticInputs:
    """The int64 buffers a ForwardBatch is viewed from: named segments of fixed capacity (tokens,
    sequences, blocks per sequence) in one host staging tensor (pinned on CUDA) and one device tensor."""

    TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping", "token_seq", "token_qidx", "logits_indices")
    SEQ_FIELDS = ("context_lens", "ssm_slots")

    def __init__(self, device: torch.device, max_tokens: int = 256, max_seqs: int = 16, max_blocks: int = 64) -> None:
        self.device = device
        self.generation = -1  # bumped at every (re)allocation: graphs over the old buffers are stale
        self._allocate(max_tokens, max_seqs, max_blocks)

    def _allocate(self, max_tokens: int, max_seqs: int, max_blocks: int) -> None:
        self.generation += 1
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        sizes = {**{f: max_tokens for f in self.TOKEN_FIELDS}, **{f: max_seqs for f in self.SEQ_FIELDS},
                 "query_start_loc": max_seqs + 1, "block_tables": max_seqs * max_blocks}
        self.offsets, o = {}, 0
        for name, n in sizes.items():
            self.offsets[name] = o
            o += n
        pin = self.device.type == "cuda"
        self.host = torch.zeros(o, dtype=torch.int64, pin_memory=pin)
        self.np = self.host.numpy()
        self.dev = self.host if self.device.type == "cpu" else torch.zeros(o, dtype=torch.int64, device=self.device)
        self._views: dict[tuple, torch.Tensor] = {}  # device views by (segment, n): a slice costs the host ~4 us, ~12 a step
        self._copied = None  # torch.cuda.Event: the last upload's copy has run (the host may rewrite the staging)

    def ensure(self, tokens: int, seqs: int, blocks: int) -> None:
        if tokens > self.max_tokens or seqs > self.max_seqs or blocks > self.max_blocks:
            self._allocate(max(tokens, 2 * self.max_tokens), max(seqs, 2 * self.max_seqs), max(blocks, 2 * self.max_blocks))

    def staging(self, name: str, n: int) -> np.ndarray:
        """The first n entries of a segment in the host staging buffer (what build writes)."""
        o = self.offsets[name]
        return self.np[o:o + n]

    def device_view(self, name: str, n: int) -> torch.Tensor:
        """The first n entries of a segment on the device (what the model reads); the same view object for
        the same (name, n) until the buffers are reallocated."""
        view = self._views.get((name, n))
        if view is None:
            o = self.offsets[name]
            view = self._views[(name, n)] = self.dev[o:o + n]
        return view

    def tables(self, rows: int, width: int, device: bool = False):
        """The block tables [rows, width] (a segment laid out `width` wide)."""
        if device:
            view = self._views.get(("tables", rows, width))
            if view is None:
                view = self._views[("tables", rows, width)] = self.device_view("block_tables", rows * width).view(rows, width)
            return view
        return self.staging("block_tables", rows * width).reshape(rows, width)

    def upload(self) -> None:
        """One host -> device copy of everything a step needs (on CPU the staging buffer is the device's)."""
        if self.dev is not self.host:
            self.dev.copy_(self.host, non_blocking=True)
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()

    def wait_upload(self) -> None:
        """Before the staging buffer is rewritten: the last upload has left it (a step decoded ahead is
        queued behind the one that runs, with its upload; spec/decode_ahead.py)."""
        if self._copied is not None:
            self._copied.synchronize()


def stage_rows(inp: StaticInputs, rows: list, starts: list[int], tables: list[list[int]], lay, bs: int) -> int:
    """Stages every real row of a step (specialists/runner.py's BatchRow: tokens, positions, slots, table,
    context) into inp's host buffers, laid out as `lay` (Layout); -> its logits rows. Whole
    arrays at once; steps of uniform rows (no prefill, one length) skip the general index arithmetic."""
    B = len(rows)
    ids, pos, slots, tseq, tq, lidx = (inp.staging(f, lay.Tp) for f in StaticInputs.TOKEN_FIELDS)
    qsl = inp.staging("query_start_loc", lay.Bp + 1)
    tab = inp.tables(lay.Bp, lay.width)
    tab[:] = 0
    q = np.fromiter((row.q for row in rows), np.int64, B)
    end = np.asarray(starts, dtype=np.int64) + q
    lens = np.fromiter(map(len, tables), np.int64, B)
    short = np.flatnonzero(lens * bs < end)
    if short.size:
        b = int(short[0])
        raise ValueError(f"seq {rows[b].seq_id}: block table covers {lens[b] * bs} < {end[b]} positions")
    ids_flat: list[int] = []
    for row in rows:
        ids_flat += row.tokens
        ids_flat += [0] * (row.q - len(row.tokens))  # the drafts' places: `run` puts them in on the device
    if lay.uniform:  # decodes / verifies of one length (most steps): rows of Q tokens, every token's logits
        Q, T = lay.q_pad, lay.T
        qsl[:B + 1] = np.arange(0, (B + 1) * Q, Q)
        for b, table in enumerate(tables):
            tab[b, :len(table)] = table
        tseq[:T] = np.repeat(np.arange(B), Q) if Q > 1 else np.arange(B)
        tq[:T] = np.tile(np.arange(Q), B) if Q > 1 else 0
    else:
        qsl[0] = 0
        np.cumsum(q, out=qsl[1:B + 1])
        T = int(qsl[B])
        tab[np.repeat(np.arange(B), lens), np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)] = \
            [b for table in tables for b in table]
        tseq[:T] = np.repeat(np.arange(B), q)
        tq[:T] = np.arange(T) - np.repeat(qsl[:B], q)
    ids[:T] = ids_flat
    pos[:T] = np.repeat(end - q, q) + tq[:T]
    slots[:T] = tab[tseq[:T], pos[:T] // bs] * bs + pos[:T] % bs
    inp.staging("context_lens", lay.Bp)[:B] = end
    inp.staging("ssm_slots", lay.Bp)[:B] = [row.ssm_slot for row in rows]
    if lay.uniform:
        lidx[:T] = np.arange(T)
        return T
    # a prefill wants its last token's logits, a decode / verify every token's
    prefill = np.fromiter((row.prefill for row in rows), bool, B)
    keep = np.flatnonzero(~np.repeat(prefill, q) | (tq[:T] == np.repeat(q - 1, q)))
    lidx[:keep.size] = keep
    return int(keep.size)


def pad_rows(inp: StaticInputs, kv, ssm, b0: int, Bp: int, t: int, q: int, static: bool, width: int) -> None:
    """Padding rows b0..Bp-1 from flat token t: q tokens each at positions 0.., in the KV cache's scratch
    block and the SSM cache's scratch slot (written with the step's other rows, in the staging buffer;
    tables `width` wide)."""
    bs = kv.block_size
    tab = inp.tables(Bp, width)
    ids, pos, slots, tseq, tq, lidx = (inp.staging(f, t + (Bp - b0) * q) for f in StaticInputs.TOKEN_FIELDS)
    ctx, sslot = inp.staging("context_lens", Bp), inp.staging("ssm_slots", Bp)
    qsl = inp.staging("query_start_loc", Bp + 1)
    scratch_slot = ssm.scratch_slot if ssm is not None else -1
    for b in range(b0, Bp):
        ids[t:t + q] = 0
        pos[t:t + q] = np.arange(q)
        slots[t:t + q] = flat_slots([kv.scratch_block], 0, q, bs)
        tseq[t:t + q] = b
        tq[t:t + q] = np.arange(q)
        tab[b, 0] = kv.scratch_block
        ctx[b] = q
        sslot[b] = scratch_slot
        if static:  # a static batch computes every row's logits
            lidx[t:t + q] = np.arange(t, t + q)
        t += q
        qsl[b + 1] = t


def place_drafts(batch, rows: list, drafts: torch.Tensor) -> None:
    """Puts drafts [n, kmax] (row b's first rows[b].k; a static batch: n = its padded rows) in their
    places after each row's host tokens (rows: the runner's BatchRows), in batch.input_ids on the device."""
    n, kmax = drafts.shape
    if n >= len(rows) and all(not r.prefill and len(r.tokens) == 1 and r.k == kmax for r in rows):
        batch.input_ids[: n * (kmax + 1)].view(n, kmax + 1)[:, 1:].copy_(drafts)  # rows of one shape
        return
    idx: list[int] = []
    src: list[int] = []
    t = 0
    for b, r in enumerate(rows):
        idx.extend(range(t + len(r.tokens), t + r.q))
        src.extend(range(b * kmax, b * kmax + r.k))
        t += r.q
    if idx:
        dev = drafts.device
        batch.input_ids.index_copy_(0, device_ints(idx, dev), drafts.reshape(-1)[device_ints(src, dev)])


def advance_rows(batch, packed: torch.Tensor, drafts: torch.Tensor, B: int, block_size: int) -> None:
    """A static verify batch built at the rows' committed ends, moved on the device past what the verify
    before it keeps (spec/verify_ahead.py): row b (of B real rows) starts packed[b, 0] + 1 positions
    later (its kept drafts and the fed token), feeds that verify's target token then drafts[b]; its
    slots are read from its block table, its context grows alike. Padding rows stay as built. On CUDA
    one kernel (ops/rows_cuda.advance_rows): these torch ops cost the host ~13 launches a speculative step."""
    q = batch.max_query_len
    fields = (batch.input_ids, batch.positions, batch.slot_mapping, batch.context_lens, batch.block_tables, packed, drafts)
    if fused_advance(*fields) and os.environ.get("CANTATA_FUSED_ADVANCE", "1") != "0":
        rows_advance(*fields, B, q, block_size)
        return
    kept = packed[:B, 0]
    step = kept + 1
    ids = batch.input_ids.view(-1, q)[:B]
    ids[:, 0] = packed[:B].gather(1, step[:, None])[:, 0]  # packed row: count, the run's tokens, drafts
    if q > 1:
        ids[:, 1:] = drafts[:B, :q - 1]
    pos = batch.positions.view(-1, q)[:B]
    pos += step[:, None]
    slots = batch.block_tables[:B].gather(1, pos // block_size).to(pos.dtype) * block_size + pos % block_size
    batch.slot_mapping.view(-1, q)[:B] = slots
    batch.context_lens[:B] += step


BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_GRAPH_BATCH = 64  # static (graph) batches up to this many rows; larger ones run eagerly
MIN_CONTEXT_WIDTH = 256  # the smallest attention width of a static batch


def bucket_size(n: int) -> int:
    """The smallest bucket >= n (n itself past the largest bucket)."""
    for b in BUCKETS:
        if b >= n:
            return b
    return n


def context_width(n: int, cap: int) -> int:
    """The attention width of a static batch whose longest context is n: the smallest power of two
    >= max(n, MIN_CONTEXT_WIDTH), at most cap (the block tables' full width in positions)."""
    w = MIN_CONTEXT_WIDTH
    while w < n:
        w *= 2
    return min(w, cap)


def exact_rows(device: str | torch.device, dtype: torch.dtype) -> int:
    """Rows a static step may have (padding included) with every product giving a row the same bits at
    any row count, so that a verify computes exactly its decodes' tokens: on CUDA in half precision
    decode_fused.MAX_ROWS (its `mma` products; above, cuBLAS picks kernels by the row count); elsewhere
    no limit (fp32: see ops/linear.py)."""
    if torch.device(device).type != "cuda" or dtype not in HALF:
        return 1 << 30
    from specialists.ops.decode_fused import MAX_ROWS  # Triton: a GPU install has it

    logging.getLogger(__name__).info("half precision on CUDA: a speculative step verifies at most %d rows, so that "
                                     "speculation stays exact (K <= 7 at batch 8, 3 at 16, 1 at 32)", MAX_ROWS)
    return MAX_ROWS
