"""One target forward for a scheduled step: builds the flattened batch, runs the model, returns the
logits rows acceptance needs and every token's hidden state (the drafter rebuilds its entries from
them).

Rows are prefills (their new tokens; logits of the last one) and decodes / verifies ([last token,
d1..dk]; logits of each). Draft tokens are still on the device when the batch is built: the host
puts placeholders and `fill` scatters the drafts in, so no sync is needed between drafting and
verification.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specialists.models.batch import ForwardBatch
from state.kv_cache import KVCache
from state.ssm_cache import SSMCache


@dataclass
class StepResult:
    logits: torch.Tensor  # [n, V] float32, rows at batch.logits_indices (prefill: last token; decode: all)
    hidden: torch.Tensor  # [T, d] the final-normed hidden state of every token of the batch
    batch: ForwardBatch


class Runner:
    def __init__(self, model, kv: KVCache, ssm: SSMCache | None, device: str | torch.device) -> None:
        self.model = model
        self.kv = kv
        self.ssm = ssm
        self.device = device

    @torch.inference_mode()
    def run(
        self,
        rows: list[tuple[int, list[int], bool, int]],  # (seq_id, new token ids, is_prefill, ssm slot)
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,  # (flat token index [n], token id [n]) on device
    ) -> StepResult:
        slots = [slot for *_, slot in rows] if self.ssm is not None else None
        batch = ForwardBatch.from_kv(self.kv, [(sid, toks, pre) for sid, toks, pre, _ in rows], slots, self.device)
        if fill is not None:
            batch.input_ids.index_copy_(0, fill[0], fill[1])
        hidden = self.model.forward(batch, self.kv, self.ssm)  # [T, d]
        return StepResult(self.model.logits(hidden[batch.logits_indices]).float(), hidden, batch)
