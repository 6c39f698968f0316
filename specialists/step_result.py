"""What the runner's forward returns (specialists/runner.py): a step's logits rows and hidden states,
and for a static batch what its graph computed over the padded rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from specialists.models.batch import ForwardBatch


class Staged(NamedTuple):
    """A static step's per-token Mamba states, [Bp, q, L, ...] over its Mamba layers (specialists/staged_states.py)."""

    conv: torch.Tensor
    ssm: torch.Tensor


class StaticOutputs(NamedTuple):
    """What a static step (graph) computes over its padded batch; rewritten by each replay."""

    hidden: torch.Tensor  # [Tp, d]
    logits: torch.Tensor  # [Tp, V] float32
    best: torch.Tensor  # [Tp] argmax of each logits row
    draft_out: torch.Tensor | None  # [Tp, d] the drafter's rebuilt entries (rebuild in the graph)
    staged: Staged | None  # the Mamba layers' per-token states (hybrids)
    packed: torch.Tensor  # [Bp, 2q] the rows' greedy acceptance, spec.acceptance.pack's layout
    masked: bool = False  # the logits were masked with the step's grammars in the graph


@dataclass
class StepResult:
    logits: torch.Tensor  # [n, V] float32, rows at batch.logits_indices (prefill: last token; decode: all)
    hidden: torch.Tensor  # [T, d] the final-normed hidden state of every (real) token of the batch
    batch: ForwardBatch  # the real rows (views into the runner's static buffers: valid until the next step)
    static: StaticOutputs | None = None  # a static batch's graph outputs (padded rows included)
