"""The named data of one speculative step (spec/speculator.py): plan -> proposal -> (the runner's
forward) -> acceptance -> output. Host lists and device tensors are kept apart: a row's host tokens are what the
host knows before the step (a prefill's tokens, a decode's last token); its drafts stay on the device
in the proposal until the step's one host copy brings them back with the acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from spec.acceptance import Method, TypicalParams
from spec.grammar import StepMasks


@dataclass
class Row:
    """One sequence's part of a step (the runner reads seq_id, tokens, prefill, ssm_slot, k, q)."""

    seq: Any  # specialists.scheduler.Sequence: seq_id, ssm_slot, output_ids, params, generator
    prefill: bool
    tokens: list[int]  # host tokens fed: a prefill's new tokens, or [last emitted token]
    k: int = 0  # drafts verified after them (0 for prefills and plain decodes)
    t0: int = 0  # flat index of the row's first token in the batch

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def ssm_slot(self) -> int:
        return self.seq.ssm_slot

    @property
    def q(self) -> int:
        """Tokens the row feeds the target: its host tokens, then its drafts."""
        return len(self.tokens) + self.k


@dataclass
class StaticShape:
    """A static step (CUDA graphs on a GPU): every row a decode with k drafts, padded to `rows`."""

    rows: int  # the batch bucket Bp
    width: int  # the attention width (a bucket >= every context)
    committed: list[int]  # [B] each sequence's committed length before the step


@dataclass
class StepPlan:
    rows: list[Row]  # prefills, then decodes, in batch order
    k: int  # the most drafts a row verifies (kmax); every row's logits are padded to k + 1
    method: Method  # acceptance of sampled rows (greedy rows are exact whatever the method)
    typical: TypicalParams
    rebuild: bool  # rebuild the drafter's entries from this step's hidden states
    greedy: bool  # every row greedy: exact acceptance by the target's argmax
    static: StaticShape | None = None
    multi: int = 1  # > 1: that many greedy one-token decodes in one static forward (no drafts)
    masks: StepMasks | None = None  # the grammar masks of guided rows (spec/grammar.py); None: no row guided
    limits: list[int] | None = None  # a guided static step: drafts each row may keep (its chain may stop early)
    owe_new: bool = False  # no rebuild, and new prompts' drafter entries are owed too (spec/catchup.py)

    def settle(self, num_drafts: list[int]) -> None:
        """Each row's drafts once they are proposed (a chain may stop early), and the batch layout."""
        t = 0
        for r, n in zip(self.rows, num_drafts):
            r.k, r.t0 = n, t
            t += r.q
        self.k = max(num_drafts, default=0)


@dataclass
class Proposal:
    drafts: torch.Tensor | None  # [B or Bp, k] int64 on the device, batch row order; None: no row drafts
    ahead: bool = False  # drafted ahead, right after the previous step's verify


@dataclass
class AheadChain:
    """Drafts made right after a greedy static verify for the step after it: valid if that step
    decodes the same sequences at the committed lengths assumed (every run committed whole)."""

    seq_ids: list[int]
    committed: list[int]  # [S] each sequence's committed length once its run is committed
    k: int
    drafts: torch.Tensor  # [Bp, k] a static tensor (the drafter's chain_ahead graph output)

    def matches(self, plan: StepPlan) -> bool:
        st = plan.static
        return (st is not None and self.k == plan.k and self.committed == st.committed
                and self.seq_ids == [r.seq_id for r in plan.rows])


@dataclass
class Accepted:
    """The acceptance of a verified plan, on the device (spec/acceptance.py)."""

    tokens: torch.Tensor  # [B, k+1] each row's run first (kept drafts, target token), then ignored entries
    packed: torch.Tensor  # [B, 1 + (k+1) + k] spec.acceptance.pack: the step's one host copy


@dataclass
class StepOutput:
    """A step's outcome on the host, before the engine cuts the runs at triggers."""

    runs: list[list[int]]  # [B] kept drafts + the target's token
    drafts: list[list[int]] = field(default_factory=list)  # [B] the verified drafts, for commit
    draft_s: float = 0.0
    verify_s: float = 0.0
    mask_s: float = 0.0  # host time on grammar masks (filling, the drafter's reads, applying)
    rebuild_s: float = 0.0  # host time of the drafter's rebuild outside a graph (in verify_s too)
    catchup_s: float = 0.0  # of which the catch-up of owed entries (spec/catchup.py): a resume's one-off cost
