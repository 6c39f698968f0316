"""One model forward for a scheduled step: builds the flattened batch, runs the model, returns the
logits rows the sampler needs and the last hidden states the drafter will need.

On CPU the batch tensors are built fresh each step (cheap at these sizes). The GPU path (static
buffers padded to batch-size buckets, CUDA graphs for the decode and verify shapes) is the next step
of the engine issue and plugs in here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specialists.models.batch import ForwardBatch
from specialists.scheduler import ScheduledStep
from state.kv_cache import KVCache
from state.ssm_cache import SSMCache


@dataclass
class StepResult:
    logits: torch.Tensor  # [B, V] one row per scheduled sequence, prefills first then decodes
    hidden: torch.Tensor  # [B, d] the final-normed hidden state of each row's last token


class Runner:
    def __init__(self, model, kv: KVCache, ssm: SSMCache | None, device: str | torch.device) -> None:
        self.model = model
        self.kv = kv
        self.ssm = ssm
        self.device = device

    @torch.inference_mode()
    def run(self, step: ScheduledStep) -> StepResult:
        rows = [(seq.seq_id, tokens, True) for seq, tokens in step.prefills]
        rows += [(seq.seq_id, [seq.output_ids[-1]], False) for seq in step.decodes]
        slots = [seq.ssm_slot for seq, _ in step.prefills] + [seq.ssm_slot for seq in step.decodes]
        batch = ForwardBatch.from_kv(self.kv, rows, slots if self.ssm is not None else None, self.device)
        hidden = self.model.forward(batch, self.kv, self.ssm)  # [T, d]
        last = hidden[batch.logits_indices]  # [B, d]: prefills want their last token, decodes their one token
        return StepResult(self.model.logits(last).float(), last)
