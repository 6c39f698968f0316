"""One target forward for a scheduled step: builds the flattened batch in static buffers, runs the
model, returns the logits rows acceptance needs and every token's hidden state (the drafter rebuilds
its entries from them).

Rows are prefills (their new tokens; logits of the last one) and decodes / verifies ([last token,
d1..dk]; logits of each). Draft tokens are still on the device when the batch is built: the host
puts placeholders and `fill` scatters the drafts in, so no sync is needed between drafting and
verification.

Static buffers: every index tensor of a batch (token ids, positions, KV slots, block tables, ...)
is a view into one int64 buffer allocated once (and grown only when a step needs more room). The
host fills a staging copy and the device gets it in one copy (on CPU the staging buffer is the
device buffer). Batch-size buckets: a batch of decodes or verifies that all feed the same number of
tokens (the steady state of a serving engine) is padded to the next bucket size (1, 2, 4, 8, ...)
with rows that read the KV cache's scratch block and the SSM cache's scratch slot and write nothing
that is ever read, so a step's shapes come from a small fixed set, which is what CUDA graph capture
and shape-specialized kernels need. Padding is on by default on CUDA and off on CPU, where padded
rows are only extra work.

CUDA graphs (specialists/graphs.py): a step whose rows all decode or verify the same number of
tokens is a *static* batch: padded to its bucket, its block tables at the buffers' full width, and
its attention over a context width W from a few buckets (256, 512, 1024, ... up to the longest
sequence) with the lengths read on the device, so that the forward (plus the argmax and, for a
speculating greedy step, the drafter's rebuild) is one graph per (bucket, tokens per row, W) that is
captured once and replayed. A static batch stages the Mamba states even of a plain decode (its
forward writes no state; the engine's commit does), which is what lets a graph run twice to the
same effect. Prefills and mixed steps run eagerly. On by default on CUDA; `static_batches=True`
runs the same static forward eagerly (the CPU tests of this path; CANTATA_STATIC_BATCHES=1 does it
for every engine, e.g. a whole test run).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from specialists.graphs import GraphCache, graphs_allowed
from specialists.models.batch import ForwardBatch
from state.kv_cache import KVCache
from state.ssm_cache import SSMCache

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


def _step_key(rows: int, q: int, width: int, rebuild) -> tuple:
    """The graph key of a static step: its shape, and whether the drafter's rebuild is in it."""
    return ("step", rows, q, width, rebuild is not None)


@dataclass
class StepResult:
    logits: torch.Tensor  # [n, V] float32, rows at batch.logits_indices (prefill: last token; decode: all)
    hidden: torch.Tensor  # [T, d] the final-normed hidden state of every (real) token of the batch
    batch: ForwardBatch  # the real rows (views into the runner's static buffers: valid until the next step)
    best: torch.Tensor | None = None  # [n] argmax of each logits row (static batches)
    draft_out: torch.Tensor | None = None  # [Tp, d] the drafter's rebuilt entries (static batch, rebuild given)
    packed: torch.Tensor | None = None  # [Bp, 2q - 1] each (padded) row's argmaxes, then its fed drafts (static batch)


class StaticInputs:
    """The int64 buffers a ForwardBatch is viewed from: segments of fixed capacity (tokens, sequences,
    blocks per sequence) in one host staging tensor (pinned on CUDA) and one device tensor."""

    _TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping", "token_seq", "token_qidx", "logits_indices")
    _SEQ_FIELDS = ("context_lens", "ssm_slots")

    def __init__(self, device: torch.device, max_tokens: int = 256, max_seqs: int = 16, max_blocks: int = 64) -> None:
        self.device = device
        self.generation = -1  # bumped at every (re)allocation: graphs over the old buffers are stale
        self._allocate(max_tokens, max_seqs, max_blocks)

    def _allocate(self, max_tokens: int, max_seqs: int, max_blocks: int) -> None:
        self.generation += 1
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        sizes = [max_tokens] * len(self._TOKEN_FIELDS) + [max_seqs] * len(self._SEQ_FIELDS) + [max_seqs + 1, max_seqs * max_blocks]
        self.offsets, o = [], 0
        for n in sizes:
            self.offsets.append(o)
            o += n
        self.size = o
        pin = self.device.type == "cuda"
        self.host = torch.zeros(o, dtype=torch.int64, pin_memory=pin)
        self.np = self.host.numpy()
        self.dev = self.host if self.device.type == "cpu" else torch.zeros(o, dtype=torch.int64, device=self.device)

    def ensure(self, tokens: int, seqs: int, blocks: int) -> None:
        if tokens > self.max_tokens or seqs > self.max_seqs or blocks > self.max_blocks:
            self._allocate(max(tokens, 2 * self.max_tokens), max(seqs, 2 * self.max_seqs), max(blocks, 2 * self.max_blocks))

    def segment(self, i: int, n: int, host: bool = True):
        o = self.offsets[i]
        return (self.np if host else self.dev)[o:o + n]


class Runner:
    def __init__(self, model, kv: KVCache, ssm: SSMCache | None, device: str | torch.device,
                 pad_batches: bool | None = None, cuda_graphs: bool | None = None,
                 static_batches: bool = False, max_model_len: int = 2048, max_num_seqs: int = 16) -> None:
        self.model = model
        self.kv = kv
        self.ssm = ssm
        self.device = torch.device(device)
        graphs = graphs_allowed(self.device, cuda_graphs)
        static = graphs or static_batches or os.environ.get("CANTATA_STATIC_BATCHES") == "1"
        self.pad_batches = (self.device.type == "cuda" or static) if pad_batches is None else pad_batches
        # block tables wide enough for max_model_len (+ a verify's lookahead): static batches use the full width
        blocks = -(-max_model_len // kv.block_size) + 2
        self.inputs = StaticInputs(self.device, max_tokens=max(256, 8 * max_num_seqs),
                                   max_seqs=max(16, bucket_size(max_num_seqs)), max_blocks=max(64, blocks))
        # static batches are padded ones: pad_batches=False turns them (and the graphs) off
        self.static = static and self.pad_batches
        self.graphs = GraphCache(graphs and self.static)
        self._generation = self.inputs.generation
        self.padded_steps = 0  # steps that ran with padding rows (for tests and metrics)
        self.static_steps = 0  # steps that ran as static batches (graphs on CUDA)

    @property
    def max_context_width(self) -> int:
        return self.inputs.max_blocks * self.kv.block_size

    def context_widths(self) -> list[int]:
        """Every attention width a static batch can have."""
        out = [context_width(1, self.max_context_width)]
        while out[-1] < self.max_context_width:
            out.append(context_width(out[-1] + 1, self.max_context_width))
        return out

    def graph_buckets(self, max_rows: int) -> list[int]:
        """The batch buckets a static batch of at most max_rows rows can have."""
        return [b for b in BUCKETS if b <= min(bucket_size(max_rows), MAX_GRAPH_BATCH)]

    def static_shape(self, num_rows: int, max_context: int) -> tuple[int, int]:
        """(padded rows, attention width) of a static batch of num_rows rows, the longest context max_context."""
        return bucket_size(num_rows), context_width(max_context, self.max_context_width)

    def static_batch(self, num_rows: int, q: int) -> bool:
        """Whether a batch of num_rows decode / verify rows of q tokens each runs static (a graph)."""
        return self.static and q <= self.kv.block_size and bucket_size(num_rows) <= MAX_GRAPH_BATCH

    def build(self, rows: list[tuple[int, list[int], bool, int]]) -> tuple[ForwardBatch, ForwardBatch]:
        """rows (seq_id, new token ids, is_prefill, ssm slot) -> (the padded batch the model runs, the
        real rows' batch: a prefix of the same buffers)."""
        if not rows:
            raise ValueError("empty batch")
        kv, bs = self.kv, self.kv.block_size
        starts = [kv.num_computed(sid) for sid, *_ in rows]
        tables = [kv.block_table(sid) for sid, *_ in rows]
        qlens = [len(toks) for _, toks, _, _ in rows]
        if 0 in qlens:
            raise ValueError(f"seq {rows[qlens.index(0)][0]}: no new tokens")
        B = len(rows)
        pad = 0
        uniform = not any(pre for _, _, pre, _ in rows) and len(set(qlens)) == 1
        static = uniform and self.static_batch(B, qlens[0])
        if static or (self.pad_batches and uniform and qlens[0] <= bs):
            pad = bucket_size(B) - B
            self.padded_steps += pad > 0
        q_pad = qlens[0]
        T, Tp, Bp = sum(qlens), sum(qlens) + pad * q_pad, B + pad
        width = max(max(len(t) for t in tables), 1)
        inp = self.inputs
        inp.ensure(Tp, Bp, width)
        if static:  # the full width: a graph's views do not depend on the step
            width = inp.max_blocks

        ids, pos, slots, tseq, tq, lidx = (inp.segment(i, Tp) for i in range(6))
        ctx, sslot = inp.segment(6, Bp), inp.segment(7, Bp)
        qsl = inp.segment(8, Bp + 1)
        tab = inp.segment(9, Bp * width).reshape(Bp, width)
        tab[:] = 0
        qsl[0] = 0
        t = n_logits = 0
        for b, ((sid, toks, pre, slot), start, table, q) in enumerate(zip(rows, starts, tables, qlens)):
            end = start + q
            if len(table) * bs < end:
                raise ValueError(f"seq {sid}: block table covers {len(table) * bs} < {end} positions")
            ids[t:t + q] = toks
            p = np.arange(start, end)
            pos[t:t + q] = p
            slots[t:t + q] = np.asarray(table)[p // bs] * bs + p % bs
            tseq[t:t + q] = b
            tq[t:t + q] = np.arange(q)
            tab[b, :len(table)] = table
            ctx[b] = end
            sslot[b] = slot
            if pre:  # a prefill wants its last token's logits, a decode / verify every token's
                lidx[n_logits] = t + q - 1
                n_logits += 1
            else:
                lidx[n_logits:n_logits + q] = np.arange(t, t + q)
                n_logits += q
            t += q
            qsl[b + 1] = t
        if pad:
            self._pad_rows(B, Bp, t, q_pad, static, width)
        if self.device.type != "cpu":  # one host -> device copy of everything the step needs
            inp.dev.copy_(inp.host, non_blocking=True)

        max_ctx = int(ctx[:Bp].max())
        if static:
            max_ctx = context_width(max_ctx, self.max_context_width)
            self.static_steps += 1

        def batch(nb: int, nt: int, nl: int) -> ForwardBatch:
            return self._views(nb, nt, nl, Bp, width, [r[0] for r in rows] + [-1] * (nb - B),
                               qlens + [q_pad] * (nb - B), [r[2] for r in rows] + [False] * (nb - B),
                               max_ctx if static else int(ctx[:nb].max()), static, nb - B)

        real = batch(B, T, n_logits)
        return (batch(Bp, Tp, Tp if static else n_logits) if pad else real), real

    def _views(self, nb: int, nt: int, nl: int, Bp: int, width: int, seq_ids: list[int], qlens: list[int],
               is_prefill: list[bool], max_ctx: int, static: bool, num_pad: int) -> ForwardBatch:
        """A ForwardBatch of the first nb rows / nt tokens / nl logits rows (the last num_pad of them
        padding), as views of the device buffers (block tables laid out [Bp, width])."""
        inp = self.inputs
        seg = lambda i, n: inp.segment(i, n, host=False)  # noqa: E731
        return ForwardBatch(
            input_ids=seg(0, nt), positions=seg(1, nt), seq_ids=seq_ids, query_start_loc=seg(8, nb + 1),
            context_lens=seg(6, nb), block_tables=seg(9, Bp * width).view(Bp, width)[:nb], slot_mapping=seg(2, nt),
            ssm_slots=seg(7, nb), logits_indices=seg(5, nl), query_lens=qlens, is_prefill=is_prefill,
            token_seq=seg(3, nt), token_qidx=seg(4, nt), max_query_len=max(qlens), max_context_len=max_ctx,
            ssm_slot_list=inp.segment(7, nb).tolist(), num_pad=num_pad, static=static,
        )

    def _pad_rows(self, b0: int, Bp: int, t: int, q: int, static: bool, width: int) -> None:
        """Padding rows b0..Bp-1 from flat token t: q tokens each at positions 0.., in the scratch block
        and slot (written with the step's other rows, in the staging buffer; tables `width` wide)."""
        inp, kv, bs = self.inputs, self.kv, self.kv.block_size
        tab = inp.segment(9, Bp * width).reshape(Bp, width)
        ids, pos, slots, tseq, tq, lidx = (inp.segment(i, t + (Bp - b0) * q) for i in range(6))
        ctx, sslot, qsl = inp.segment(6, Bp), inp.segment(7, Bp), inp.segment(8, Bp + 1)
        scratch_slot = self.ssm.scratch_slot if self.ssm is not None else -1
        for b in range(b0, Bp):
            ids[t:t + q] = 0
            pos[t:t + q] = np.arange(q)
            slots[t:t + q] = kv.scratch_block * bs + np.arange(q)
            tseq[t:t + q] = b
            tq[t:t + q] = np.arange(q)
            tab[b, 0] = kv.scratch_block
            ctx[b] = q
            sslot[b] = scratch_slot
            if static:  # a static batch computes every row's logits
                lidx[t:t + q] = np.arange(t, t + q)
            t += q
            qsl[b + 1] = t

    @torch.inference_mode()
    def capture(self, num_rows: int, q: int, width: int, rebuild=None) -> bool:
        """Captures the static step graph of (num_rows bucket, q tokens per row, context width) on a
        batch of padding rows only (they read and write only the scratch block and slot), so that no
        request pays for the capture. False when there are no graphs or it is captured already."""
        Bp = bucket_size(num_rows)
        if not self.graphs.enabled or self.graphs.has(_step_key(Bp, q, width, rebuild)) or not self.static_batch(Bp, q):
            return False
        inp = self.inputs
        inp.ensure(Bp * q, Bp, inp.max_blocks)
        inp.segment(9, Bp * inp.max_blocks)[:] = 0
        inp.segment(8, 1)[0] = 0
        self._pad_rows(0, Bp, 0, q, True, inp.max_blocks)
        if self.device.type != "cpu":
            inp.dev.copy_(inp.host, non_blocking=True)
        T = Bp * q
        batch = self._views(Bp, T, T, Bp, inp.max_blocks, [-1] * Bp, [q] * Bp, [False] * Bp, width, True, Bp)
        self._static_step(batch, rebuild)
        torch.cuda.synchronize()  # the staging buffer is rewritten by the next capture or step
        return True

    def _static_step(self, batch: ForwardBatch, rebuild) -> tuple:
        """The graph of a static batch (captured on its shape's first call): forward, logits, argmax
        and, given, the rebuild; -> (hidden, logits, best, draft_out, staged, packed) of the padded batch."""
        if self.inputs.generation != self._generation:  # the buffers were reallocated
            self.graphs.clear()
            self._generation = self.inputs.generation

        def step():
            batch.__dict__.pop("_attn_meta", None)  # built inside the graph, from the static buffers
            batch.staged = []
            hidden = self.model.forward(batch, self.kv, self.ssm)  # [Tp, d]
            logits = self.model.logits(hidden).float()
            best = logits.argmax(-1)
            staged = None
            if batch.staged:  # Mamba layers in order: [Bp, q, L, ...] per-token states of every layer
                staged = (torch.stack([c for _, c, _ in batch.staged], dim=2),
                          torch.stack([s for _, _, s in batch.staged], dim=2))
            # argmaxes and the fed drafts side by side: the step's one device -> host copy (greedy rows)
            rows = batch.input_ids.view(batch.num_seqs, -1)
            packed = torch.cat([best.view(rows.shape), rows[:, 1:]], dim=1)
            return hidden, logits, best, (None if rebuild is None else rebuild(batch, hidden, best)), staged, packed

        return self.graphs.run(_step_key(batch.num_seqs, batch.max_query_len, batch.max_context_len, rebuild), step)

    @torch.inference_mode()
    def run(
        self,
        rows: list[tuple[int, list[int], bool, int]],  # (seq_id, new token ids, is_prefill, ssm slot)
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,  # (flat token index [n], token id [n]) on device
        fill_rows: torch.Tensor | None = None,  # [Bp, q-1] drafts of every (padded) row of a static batch
        rebuild: Callable[[ForwardBatch, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> StepResult:
        """`rebuild(batch, hidden, next_tokens)` (a static batch only): the drafter's rebuild, run
        after the forward (in its graph) with each token's argmax as the next token."""
        batch, real = self.build(rows)
        if fill is not None:
            batch.input_ids.index_copy_(0, fill[0], fill[1])
        if not batch.static:
            hidden = self.model.forward(batch, self.kv, self.ssm)  # [Tp, d]
            hidden = hidden[: real.num_tokens]
            return StepResult(self.model.logits(hidden[real.logits_indices]).float(), hidden, real)
        Bp, q = batch.num_seqs, batch.max_query_len
        if fill_rows is not None:
            batch.input_ids.view(Bp, q)[:, 1:].copy_(fill_rows)
        hidden, logits, best, draft_out, staged, packed = self._static_step(batch, rebuild)
        if staged is not None:  # the Mamba states of each token, committed after acceptance (real rows only)
            B = len(rows)
            self.ssm.stage_all([r[3] for r in rows], staged[0][:B], staged[1][:B])
        T = real.num_tokens
        return StepResult(logits[:T], hidden[:T], real, best[:T], draft_out, packed)

    def static_outputs(self, num_rows: int, q: int, width: int, rebuild=None) -> tuple | None:
        """The outputs of the captured step graph of that shape (None if not captured): (hidden,
        logits, best, draft_out, staged, packed) of the padded batch, rewritten by each replay."""
        return self.graphs.outputs(_step_key(bucket_size(num_rows), q, width, rebuild))

    def static_views(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device buffers a static batch of num_rows (padded) rows reads: its context lengths [Bp]
        and block tables [Bp, max_blocks] (what the last static step saw until the next build)."""
        inp = self.inputs
        return (inp.segment(6, num_rows, host=False),
                inp.segment(9, num_rows * inp.max_blocks, host=False).view(num_rows, inp.max_blocks))
