"""The runner's static input buffers (specialists/runner.py): every index tensor of a batch is a view
into one int64 buffer allocated once and grown only when a step needs more room; the host fills a
staging copy and the device gets it in one copy (on CPU the staging buffer is the device buffer);
`stage_rows` writes a step's rows into the staging copy, `place_drafts` a verify's drafts on the device."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from specialists.ops.attention import HALF
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
        self._copied = None  # torch.cuda.Event: the last upload's copy has run (the host may rewrite the staging)

    def ensure(self, tokens: int, seqs: int, blocks: int) -> None:
        if tokens > self.max_tokens or seqs > self.max_seqs or blocks > self.max_blocks:
            self._allocate(max(tokens, 2 * self.max_tokens), max(seqs, 2 * self.max_seqs), max(blocks, 2 * self.max_blocks))

    def staging(self, name: str, n: int) -> np.ndarray:
        """The first n entries of a segment in the host staging buffer (what build writes)."""
        o = self.offsets[name]
        return self.np[o:o + n]

    def device_view(self, name: str, n: int) -> torch.Tensor:
        """The first n entries of a segment on the device (what the model reads)."""
        o = self.offsets[name]
        return self.dev[o:o + n]

    def tables(self, rows: int, width: int, device: bool = False):
        """The block tables [rows, width] (a segment laid out `width` wide)."""
        if device:
            return self.device_view("block_tables", rows * width).view(rows, width)
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
