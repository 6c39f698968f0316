"""Where a hybrid's static steps (specialists/runner.py, CUDA graphs) write their Mamba states.

A static decode / verify of q tokens per row does not write its rows' Mamba slots: every Mamba layer
stages the conv and SSM state after each token, and the engine's commit writes the state after
exactly the kept tokens (state/ssm_cache.py stage_all / commit). Those staged states are large: a
token's SSM state is 2 MB a layer at bamba-1b (64 heads x 64 x 128, fp32), so a row of a 4-token
verify stages 96 MB over 12 layers. Were each graph to own them (its outputs, in its private memory
pool), every (batch bucket, context width, q) would keep its own: bamba-1b at max_num_seqs 8 reserved
63 GB after warm-up that way (H100, session 23: 23 GB of graph outputs, the rest the stacking's
intermediates), where its weights take 3.

So the runner owns one buffer per role, [tokens, L, ...] (L: the Mamba layers, in their cache order),
and every graph of that role writes a view of its first Bp x q tokens as [Bp, q, L, ...]. Each layer's
kernel writes its states there directly (specialists/ops/mamba2_fused.py `out`), so no stack over the
layers nor concatenation over a multi-step decode's steps is made. A buffer holds the most tokens one
step of its role stages (batch 8 at K = 3: 32; batch 64 decodes one token a row: 64). Roles:

  "step"              the one-token decode and the verify (guided or not): one such step is staged
                      at a time, and its commit is enqueued before the next step's launch
  ("multi", parity)   a multi-step decode (specialists/multistep.py); a hybrid decoding ahead
                      alternates two parities, so a step's states survive the step launched ahead of
                      its commit (spec/decode_ahead.py)

At a real hybrid's size those steps are what bounds the batch: a token's states are 128 MB at 32
Mamba layers of 128 heads, so a 64-row step of 4 tokens would stage 32 GB. Each role's buffer is held
to a budget (the engine option staged_state_mib; on a GPU by default 5% of its memory): a batch size
whose verify or multi-step decode would stage more than max_tokens verifies fewer drafts and decodes
fewer tokens a step (Runner.max_drafts, Runner.multi_steps), down to one token a row.

Graphs of one role never hold states that are still to be read while another of that role runs: the
engine reads a step's staged states at its commit, in stream order before the next launch of the
role. A buffer grows when a step needs more tokens than it has: the graphs captured over the old one
keep it alive (their outputs view it) and stay correct; warm-up reserves each role's largest step
before it captures (Runner.reserve_staged), so that no buffer grows in use.
"""

from __future__ import annotations

from typing import Hashable

import torch

from specialists.step_result import Staged

__all__ = ["StagedBuffers", "budget_mib"]

SHARE = 0.05  # of a GPU's memory, per role (bamba-1b on an H100: 163 tokens)


def budget_mib(asked: float | None, device: torch.device) -> float | None:
    """What one role's buffer may take: the engine option staged_state_mib, else on CUDA SHARE of the
    device's memory, else no bound (a CPU's static batches)."""
    if asked is not None or device.type != "cuda":
        return asked
    return SHARE * torch.cuda.get_device_properties(device).total_memory / 2**20


class StagedBuffers:
    def __init__(self, conv: torch.Tensor, ssm: torch.Tensor, budget_mib: float | None = None, rows: int = 1) -> None:
        """conv [slots, L, conv_dim, K-1], ssm [slots, L, H, P, N]: the SSM cache's tensors (the per-slot
        shapes and dtypes the buffers take). budget_mib: what one role's buffer may take (None: no
        bound), never fewer tokens than `rows` (the largest static batch's one-token decode)."""
        self._conv_shape, self._conv_dtype = tuple(conv.shape[1:]), conv.dtype
        self._ssm_shape, self._ssm_dtype = tuple(ssm.shape[1:]), ssm.dtype
        self.device = conv.device
        self.token_bytes = conv[0].nbytes + ssm[0].nbytes  # one token's states over every layer
        # the most tokens one step of a role stages (the runner's K and decode_steps per batch size keep to it)
        self.max_tokens = 1 << 30 if budget_mib is None else max(rows, int(budget_mib * 2**20) // self.token_bytes)
        self._buffers: dict[Hashable, Staged] = {}

    def views(self, role: Hashable, rows: int, tokens: int) -> Staged:
        """[rows, tokens, L, ...] views of the first rows x tokens of the role's buffer (grown first if it
        is smaller)."""
        n = rows * tokens
        buf = self._buffers.get(role)
        if buf is None or buf.ssm.shape[0] < n:
            buf = self._buffers[role] = Staged(
                torch.empty(n, *self._conv_shape, dtype=self._conv_dtype, device=self.device),
                torch.empty(n, *self._ssm_shape, dtype=self._ssm_dtype, device=self.device))
        return Staged(buf.conv[:n].view(rows, tokens, *self._conv_shape), buf.ssm[:n].view(rows, tokens, *self._ssm_shape))

    def reserve(self, role: Hashable, tokens: int) -> None:
        """The role's buffer at `tokens` at least, before a warm-up's captures: no graph then keeps a
        smaller one alive."""
        self.views(role, tokens, 1)

    @property
    def nbytes(self) -> int:
        """Bytes the current buffers take (metrics, tests)."""
        return sum(t.numel() * t.element_size() for b in self._buffers.values() for t in b)
