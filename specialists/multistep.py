"""Several greedy decode steps in one static forward (one CUDA graph, one host sync).

At real sizes on a GPU a plain decode step is a graph replay of ~1-2 ms followed by ~0.4 ms of host
work (the copy of its tokens, commit, emit, the next step's batch) while the GPU idles. With
`decode_steps` S > 1 a static batch of greedy decodes runs S steps back to back on the device: step j
feeds the argmax of step j-1, at positions p+j, into slots found through the block tables, with
contexts one longer each step. The host then treats the S tokens as one run, exactly like a verify
whose drafts were all accepted: the engine cuts it at EOS / stop / triggers / max_tokens, and the KV
cache commits the kept tokens and rolls back the rest (spec/speculator.py commit).

Each step is the same forward, over the same static buffers' layout, as a plain one-token decode of
that position, so the tokens are the ones S single steps would give. A hybrid's Mamba layers stage
each step's state for the engine's commit instead of writing it, as token j of the runner's staged
buffer (specialists/staged_states.py); step j+1 reads step j's from there (batch.ssm_carry), and the S
steps' states go to the commit as a verify's q states, so the commit keeps the state after exactly the
kept tokens.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from spec.acceptance import pack_runs
from specialists.models.batch import ForwardBatch
from specialists.ops.rows_cuda import row_argmax, step_rows
from specialists.step_result import Staged

__all__ = ["multi_decode", "step_batch"]


def step_batch(batch: ForwardBatch, tokens: torch.Tensor, j: int, block_size: int) -> ForwardBatch:
    """The one-token decode batch of step j (0-based) of `batch` (a static batch of one token per row):
    tokens [Bp] at positions + j, contexts + j, slots through the block tables."""
    if j == 0:
        return replace(batch, input_ids=tokens)
    pos, slots, ctx = step_rows(batch.positions, batch.context_lens, batch.block_tables, j, block_size)  # [Bp] each
    return replace(batch, input_ids=tokens, positions=pos, slot_mapping=slots, context_lens=ctx)


def multi_decode(model: Any, kv: Any, batch: ForwardBatch, steps: int, ssm: Any = None,
                 staged: Staged | None = None) -> tuple[torch.Tensor, torch.Tensor, Staged | None]:
    """steps greedy decodes of a static one-token batch -> (tokens [Bp, steps], packed [Bp, 1 + 2 steps]
    in spec.acceptance.pack's layout: every token kept, tokens 1..steps-1 as the fed ones, and a hybrid's
    Mamba states after each step: `staged` ([Bp, steps, L, ...] views, specialists/staged_states.py, which
    a hybrid needs), as a static verify stages them; None without)."""
    if batch.max_query_len != 1 or not batch.static:
        raise ValueError("multi_decode takes a static batch of one token per row")
    if ssm is not None and staged is None:
        raise ValueError("a hybrid's multi-step decode needs its staged buffer views")
    cur = batch.input_ids  # [Bp]
    out = []
    for j in range(steps):
        b = step_batch(batch, cur, j, kv.block_size)
        b.__dict__.pop("_attn_meta", None)  # each step's lengths differ: its own attention metadata
        if staged is not None:  # step j writes token j; step j+1 starts from it
            b.staged_out = Staged(staged.conv[:, j:j + 1], staged.ssm[:, j:j + 1])
            b.ssm_carry = Staged(staged.conv[:, j - 1], staged.ssm[:, j - 1]) if j else None
        hidden = model.forward(b, kv, ssm)  # [Bp, d]
        cur = row_argmax(model.logits(hidden))  # [Bp], as the one-token decode graph computes it
        out.append(cur)
    tokens = torch.stack(out, dim=1)  # [Bp, steps]
    return tokens, pack_runs(tokens), staged  # staged: the steps side by side (q = steps), as a verify's
