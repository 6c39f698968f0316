"""ForwardBatch: what one engine step hands to a model forward.

The new tokens of B sequences are flattened into one batch of T tokens, sequence after sequence.
Sequence b owns tokens [query_start_loc[b], query_start_loc[b+1]) (its q_b new tokens) at absolute
positions [context_lens[b] - q_b, context_lens[b]). Its K/V live in the paged pool of a KVCache
(state/kv_cache.py) at the blocks of block_tables[b]; the new tokens' K/V are written to
slot_mapping before attention reads them.

A sequence is either a prefill (its Mamba states are written at once) or a decode/verify of q
tokens (q = 1 or K+1: the per-token Mamba states are staged and committed by the engine after
acceptance). `build` makes a batch from per-sequence host lists; `from_kv` reads the block tables
and slots of sequences already reserved in a KVCache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from state.kv_cache import flat_slots

__all__ = ["ForwardBatch", "SeqStep"]


@dataclass
class SeqStep:
    """One sequence's part of a step (host side)."""

    seq_id: int
    token_ids: list[int]  # the q new tokens
    start: int  # absolute position of the first new token (= tokens already in the KV cache)
    block_table: list[int]  # block ids covering [0, start + q)
    is_prefill: bool = True
    logits: str = "last"  # "last" (prefill), "all" (verify / decode), "none"
    ssm_slot: int = -1  # SSMCache slot (hybrids), -1 if none


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, the new tokens of all sequences, flattened
    positions: torch.Tensor  # [T] int64, absolute position of each new token in its sequence
    seq_ids: list[int]  # [B] engine sequence ids (host)
    query_start_loc: torch.Tensor  # [B+1] int32, cumulative new-token counts; seq b owns [qsl[b], qsl[b+1])
    context_lens: torch.Tensor  # [B] int32, tokens in the KV cache after this step (num_computed + q_b)
    block_tables: torch.Tensor  # [B, max_blocks] int32, block ids, padded with 0
    slot_mapping: torch.Tensor  # [T] int64, flat KV slot (block * block_size + offset) of each new token
    ssm_slots: torch.Tensor  # [B] int64, SSMCache slot per sequence (-1: none / attention-only model)
    logits_indices: torch.Tensor  # [n] int64, flattened token indices whose logits are wanted
    query_lens: list[int]  # [B] q_b, host copy
    is_prefill: list[bool]  # [B] host; True: Mamba states written now, False: staged (decode / verify)
    token_seq: torch.Tensor  # [T] int64, which sequence (0..B-1) each flattened token belongs to
    token_qidx: torch.Tensor  # [T] int64, index of each token among its sequence's new tokens
    max_query_len: int  # max q_b
    max_context_len: int  # max context_lens
    ssm_slot_list: list[int] = field(default_factory=list)  # [B] host copy of ssm_slots (empty: not given)
    num_pad: int = 0  # the last num_pad rows are padding (a bucketed batch): computed, never committed
    # a static batch (specialists/runner.py, CUDA graphs): every row decodes / verifies max_query_len
    # tokens, block_tables have the buffers' full width, max_context_len is the attention width (a
    # bucket >= every context; the lengths themselves are read on the device), and the Mamba layers
    # write each token's states into `staged_out` instead of writing or staging them through the cache
    static: bool = False
    # a hybrid's static batch: specialists.step_result.Staged views [Bp, q, L, ...] of the runner's
    # staged buffer (specialists/staged_states.py) where its Mamba layers write the states after each token
    staged_out: Any = None
    # every query row attends alone, as the decode of its position would (specialists/ops/attention.py):
    # a row's result is then the same bit for bit in any step, which int8 products with bf16
    # activations need for speculation to stay exact (specialists/quantize.py); CPU only
    row_exact: bool = False
    # every row a prompt with nothing cached, padded to max_query_len (specialists/prefill_graph.py): each
    # attends over its own k and v (ops/attention.attends_own_kv), the rows laid out max_query_len apart
    fresh_rows: bool = False
    # every row a prompt's new tokens after its cached prefix (a prefix hit's remainder), padded to
    # max_query_len and laid out as fresh_rows are; each attends over its context gathered from the pool at
    # the width max_context_len, masked by its positions (specialists/prefill_graph.py)
    context_rows: bool = False
    # a hybrid's fresh rows with the prefix cache on: HeldStates, where its Mamba layers put the states on
    # the snapshot grid (state/ssm_snapshots.py) that the runner then holds for the step's snapshots
    held_out: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @classmethod
    def build(cls, steps: Sequence[SeqStep], block_size: int, device: str | torch.device = "cpu") -> "ForwardBatch":
        """Flattens per-sequence steps; slots are derived from the block tables."""
        if not steps:
            raise ValueError("empty batch")
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        tseq: list[int] = []
        tq: list[int] = []
        qsl = [0]
        ctx: list[int] = []
        logits_idx: list[int] = []
        max_blocks = max(len(s.block_table) for s in steps)
        tables = torch.zeros(len(steps), max(max_blocks, 1), dtype=torch.int32)
        for b, s in enumerate(steps):
            q = len(s.token_ids)
            if q == 0:
                raise ValueError(f"seq {s.seq_id}: no new tokens")
            end = s.start + q
            if len(s.block_table) * block_size < end:
                raise ValueError(f"seq {s.seq_id}: block table covers {len(s.block_table) * block_size} < {end} positions")
            t0 = qsl[-1]
            ids.extend(s.token_ids)
            pos.extend(range(s.start, end))
            slots.extend(flat_slots(s.block_table, s.start, end, block_size).tolist())
            tseq.extend([b] * q)
            tq.extend(range(q))
            qsl.append(t0 + q)
            ctx.append(end)
            if s.block_table:
                tables[b, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
            if s.logits == "last":
                logits_idx.append(t0 + q - 1)
            elif s.logits == "all":
                logits_idx.extend(range(t0, t0 + q))
            elif s.logits != "none":
                raise ValueError(f"logits must be 'last', 'all' or 'none', got {s.logits!r}")

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype, device=device)

        return cls(
            input_ids=t(ids, torch.int64),
            positions=t(pos, torch.int64),
            seq_ids=[s.seq_id for s in steps],
            query_start_loc=t(qsl, torch.int32),
            context_lens=t(ctx, torch.int32),
            block_tables=tables.to(device),
            slot_mapping=t(slots, torch.int64),
            ssm_slots=t([s.ssm_slot for s in steps], torch.int64),
            logits_indices=t(logits_idx, torch.int64),
            query_lens=[len(s.token_ids) for s in steps],
            is_prefill=[s.is_prefill for s in steps],
            token_seq=t(tseq, torch.int64),
            token_qidx=t(tq, torch.int64),
            max_query_len=max(len(s.token_ids) for s in steps),
            max_context_len=max(ctx),
            ssm_slot_list=[s.ssm_slot for s in steps],
        )

    @classmethod
    def from_kv(
        cls,
        kv,  # state.kv_cache.KVCache, room for the new tokens already reserved
        seqs: Sequence[tuple[int, list[int], bool]],  # (seq_id, new token ids, is_prefill)
        ssm_slots: Sequence[int] | None = None,  # [B]
        device: str | torch.device = "cpu",
    ) -> "ForwardBatch":
        """A batch over sequences whose new tokens start at their KV write pointer; prefills want
        the last token's logits, decode / verify steps every token's."""
        steps = [
            SeqStep(
                seq_id=sid,
                token_ids=list(toks),
                start=kv.num_computed(sid),
                block_table=kv.block_table(sid),
                is_prefill=pre,
                logits="last" if pre else "all",
                ssm_slot=-1 if ssm_slots is None else int(ssm_slots[i]),
            )
            for i, (sid, toks, pre) in enumerate(seqs)
        ]
        return cls.build(steps, kv.block_size, device)
