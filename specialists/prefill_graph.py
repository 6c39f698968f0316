"""A fresh prompt's prefill as a CUDA graph, at a padded length.

An eager prefill runs at the host's pace: SmolLM2-135M's 30 layers are ~380 kernels at ~25-50 us of
host time each, so a 142-token prefill took 11-19 ms on an H100 of which 1.9 ms on the device
(bench/RESULTS.md, session 24). A prefill with nothing cached before it, alone in its step, on an
attention-only model (a hybrid's Mamba state would run on through the padding) is padded here to the
next length of PREFILL_LENGTHS and replayed as one graph per length:

- the padding tokens come after the prompt, so causal attention keeps them out of the prompt's rows,
  and they write their K/V into the KV cache's scratch block (never read);
- every layer attends over the step's own k and v (ops/attention.attends_own_kv: flash attention
  with the causal bias, no block table, no context lengths), and the products run on the torch path
  (the padded length is past decode_fused.MAX_ROWS);
- the graph computes the logits of the prompt's last token (its index read on the device).

The padded prefill's products have more rows than the prompt, so in half precision its results may
differ in the last bits from an eager prefill of the same prompt (cuBLAS picks its kernels by the
row count), like any prefill next to a prefix hit; a speculative and a plain engine prefill alike.
Its hidden states are views of the graph's outputs, valid until the next prefill of that length
(the step's drafter rebuild reads them at once; the catch-up log keeps none on CUDA: runner.static).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from specialists.models.batch import ForwardBatch
from specialists.staging import Layout, StaticInputs, stage_rows
from specialists.step_result import StepResult

__all__ = ["PREFILL_LENGTHS", "PrefillGraphs", "prefill_length"]

PREFILL_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192)  # the first is past decode_fused.MAX_ROWS (64)


def prefill_length(n: int, cap: int) -> int | None:
    """The padded length of an n-token prefill: the smallest of PREFILL_LENGTHS >= n; None past cap."""
    for length in PREFILL_LENGTHS:
        if n <= length <= cap:
            return length
    return None


class PrefillGraphs:
    """The runner's (specialists/runner.py) padded prefills: `length` says whether a step is one,
    `run` runs it, `capture` captures every length at warm-up on the scratch block."""

    def __init__(self, runner: Any, cap: int) -> None:
        self.runner, self.cap = runner, cap
        self.steps = 0  # prefills run padded

    def lengths(self) -> list[int]:
        return [n for n in PREFILL_LENGTHS if n <= self.cap]

    def length(self, rows: list, static: bool) -> int | None:
        """The padded length of a step of `rows` (runner.BatchRow), None when it is no fresh one-sequence prefill."""
        if not static or len(rows) != 1 or not rows[0].prefill or rows[0].k:
            return None
        if self.runner.kv.num_computed(rows[0].seq_id):
            return None
        return prefill_length(len(rows[0].tokens), self.cap)

    @torch.inference_mode()
    def run(self, row: Any, length: int) -> StepResult:
        real, padded = self._build(row, length, self.runner.kv.block_table(row.seq_id))
        hidden, logits = self._replay(padded)
        self.steps += 1
        return StepResult(logits, hidden[: real.num_tokens], real)

    @torch.inference_mode()
    def capture(self, row: Any) -> int:
        """Every length's graph, on `row` (a one-token prompt the runner places in the scratch block)
        -> how many were captured."""
        runner, n = self.runner, 0
        if not runner.graphs.enabled:
            return 0
        for length in self.lengths():
            if not runner.graphs.has(("prefill", length)):
                self._replay(self._build(row, length, [runner.kv.scratch_block])[1])
                n += 1
        torch.cuda.synchronize()  # the staging buffer is rewritten by the next step
        return n

    def _replay(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        runner = self.runner
        runner._check_generation()
        model = runner.model

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            batch.__dict__.pop("_attn_meta", None)
            hidden = model.forward(batch, runner.kv, None)  # [length, d]
            return hidden, model.logits(hidden[batch.logits_indices]).float()

        return runner.graphs.run(("prefill", batch.num_tokens), forward)

    def _build(self, row: Any, length: int, table: list[int]) -> tuple[ForwardBatch, ForwardBatch]:
        """(the prompt's batch, the padded one over the same buffers) for a prefill of row's tokens at 0."""
        runner = self.runner
        inp, bs = runner.inputs, runner.kv.block_size
        inp.wait_upload()
        T = len(row.tokens)
        # the table as wide as the padded length (its columns past the prompt's blocks are zeros: the CPU's mask reads it)
        lay = Layout(B=1, T=T, Bp=1, Tp=length, q_pad=T, width=max(len(table), -(-length // bs)), static=False)
        inp.ensure(length, 1, lay.width)
        n_logits = stage_rows(inp, [row], [0], [table], lay, bs)
        ids, pos, slots, tseq, tq, _ = (inp.staging(f, length) for f in StaticInputs.TOKEN_FIELDS)
        pad = np.arange(T, length)
        ids[T:], pos[T:], tseq[T:], tq[T:] = 0, pad, 0, pad
        slots[T:] = runner.kv.scratch_block * bs + pad % bs
        inp.upload()
        real = runner._views(lay, 1, T, n_logits, [row.seq_id], [T], [True], T)
        dv = inp.device_view
        padded = replace(real, input_ids=dv("input_ids", length), positions=dv("positions", length),
                         slot_mapping=dv("slot_mapping", length), token_seq=dv("token_seq", length),
                         token_qidx=dv("token_qidx", length), query_lens=[length], max_query_len=length,
                         max_context_len=length)
        return real, padded
