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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specialists.models.batch import ForwardBatch
from state.kv_cache import KVCache
from state.ssm_cache import SSMCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_size(n: int) -> int:
    """The smallest bucket >= n (n itself past the largest bucket)."""
    for b in BUCKETS:
        if b >= n:
            return b
    return n


@dataclass
class StepResult:
    logits: torch.Tensor  # [n, V] float32, rows at batch.logits_indices (prefill: last token; decode: all)
    hidden: torch.Tensor  # [T, d] the final-normed hidden state of every (real) token of the batch
    batch: ForwardBatch  # the real rows (views into the runner's static buffers: valid until the next step)


class StaticInputs:
    """The int64 buffers a ForwardBatch is viewed from: segments of fixed capacity (tokens, sequences,
    blocks per sequence) in one host staging tensor (pinned on CUDA) and one device tensor."""

    _TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping", "token_seq", "token_qidx", "logits_indices")
    _SEQ_FIELDS = ("context_lens", "ssm_slots")

    def __init__(self, device: torch.device, max_tokens: int = 256, max_seqs: int = 16, max_blocks: int = 64) -> None:
        self.device = device
        self._allocate(max_tokens, max_seqs, max_blocks)

    def _allocate(self, max_tokens: int, max_seqs: int, max_blocks: int) -> None:
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
                 pad_batches: bool | None = None) -> None:
        self.model = model
        self.kv = kv
        self.ssm = ssm
        self.device = torch.device(device)
        self.pad_batches = self.device.type == "cuda" if pad_batches is None else pad_batches
        self.inputs = StaticInputs(self.device)
        self.padded_steps = 0  # steps that ran with padding rows (for tests and metrics)

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
        if self.pad_batches and not any(pre for _, _, pre, _ in rows) and len(set(qlens)) == 1 and qlens[0] <= bs:
            pad = bucket_size(B) - B
            self.padded_steps += pad > 0
        q_pad = qlens[0]
        T, Tp, Bp = sum(qlens), sum(qlens) + pad * q_pad, B + pad
        width = max(max(len(t) for t in tables), 1)
        inp = self.inputs
        inp.ensure(Tp, Bp, width)

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
        if pad:  # padding rows: q_pad tokens each at positions 0.., in the scratch block and slot
            scratch_slot = self.ssm.scratch_slot if self.ssm is not None else -1
            for b in range(B, Bp):
                ids[t:t + q_pad] = 0
                pos[t:t + q_pad] = np.arange(q_pad)
                slots[t:t + q_pad] = kv.scratch_block * bs + np.arange(q_pad)
                tseq[t:t + q_pad] = b
                tq[t:t + q_pad] = np.arange(q_pad)
                tab[b, 0] = kv.scratch_block
                ctx[b] = q_pad
                sslot[b] = scratch_slot
                t += q_pad
                qsl[b + 1] = t
        if self.device.type != "cpu":  # one host -> device copy of everything the step needs
            inp.dev.copy_(inp.host, non_blocking=True)

        def batch(nb: int, nt: int, nl: int) -> ForwardBatch:
            seg = lambda i, n: inp.segment(i, n, host=False)  # noqa: E731
            return ForwardBatch(
                input_ids=seg(0, nt), positions=seg(1, nt), seq_ids=[r[0] for r in rows] + [-1] * (nb - B),
                query_start_loc=seg(8, nb + 1), context_lens=seg(6, nb),
                block_tables=seg(9, Bp * width).view(Bp, width)[:nb], slot_mapping=seg(2, nt),
                ssm_slots=seg(7, nb), logits_indices=seg(5, nl), query_lens=(qlens + [q_pad] * (nb - B)),
                is_prefill=[r[2] for r in rows] + [False] * (nb - B), token_seq=seg(3, nt), token_qidx=seg(4, nt),
                max_query_len=max(qlens), max_context_len=int(ctx[:nb].max()), ssm_slot_list=sslot[:nb].tolist(),
                num_pad=nb - B,
            )

        real = batch(B, T, n_logits)
        return (batch(Bp, Tp, n_logits) if pad else real), real

    @torch.inference_mode()
    def run(
        self,
        rows: list[tuple[int, list[int], bool, int]],  # (seq_id, new token ids, is_prefill, ssm slot)
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,  # (flat token index [n], token id [n]) on device
    ) -> StepResult:
        batch, real = self.build(rows)
        if fill is not None:
            batch.input_ids.index_copy_(0, fill[0], fill[1])
        hidden = self.model.forward(batch, self.kv, self.ssm)  # [Tp, d]
        hidden = hidden[: real.num_tokens]
        return StepResult(self.model.logits(hidden[real.logits_indices]).float(), hidden, real)
