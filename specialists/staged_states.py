"""Where a hybrid's static steps (specialists/runner.py, CUDA graphs) write their Mamba states.

A static decode / verify of q tokens per row does not write its rows' Mamba slots: every Mamba layer
stages the conv and SSM state after each token, and the engine's commit writes the state after
exactly the kept tokens (state/ssm_cache.py stage_all / commit). Those staged states are large: a
token's SSM state is 2 MB a layer at bamba-1b (64 heads x 64 x 128, fp32), so a row of a 4-token
verify stages 96 MB over 12 layers. Were each graph to own them (its outputs, in its private memory
pool), every (batch bucket, context width, q) would keep its own: bamba-1b at max_num_seqs 8 reserved
63 GB after warm-up that way (H100, session 23: 23 GB of graph outputs, the rest the stacking's
intermediates), where its weights take 3.

So the runner owns one buffer per role, [rows, tokens, L, ...] (L: the Mamba layers, in their cache
order), and every graph of that role writes a view of it: its first Bp rows and q tokens. Each layer's
kernel writes its states there directly (specialists/ops/mamba2_fused.py `out`), so no stack over the
layers nor concatenation over a multi-step decode's steps is made. Roles:

  "step"              the one-token decode and the verify (guided or not): one such step is staged
                      at a time, and its commit is enqueued before the next step's launch
  ("multi", parity)   a multi-step decode (specialists/multistep.py); a hybrid decoding ahead
                      alternates two parities, so a step's states survive the step launched ahead of
                      its commit (spec/decode_ahead.py)

Graphs of one role never hold states that are still to be read while another of that role runs: the
engine reads a step's staged states at its commit, in stream order before the next launch of the
role. A buffer grows when a step needs more rows or tokens than it has: the graphs captured over the
old one keep it alive (their outputs view it) and stay correct; warm-up captures the largest q first
(Engine.capture_graphs) so that it does not grow in use.
"""

from __future__ import annotations

from typing import Hashable

import torch

from specialists.step_result import Staged

__all__ = ["StagedBuffers"]


class StagedBuffers:
    def __init__(self, conv: torch.Tensor, ssm: torch.Tensor, rows: int) -> None:
        """conv [slots, L, conv_dim, K-1], ssm [slots, L, H, P, N]: the SSM cache's tensors (the per-slot
        shapes and dtypes the buffers take); rows: the most rows a static batch has (its largest bucket)."""
        self._conv_shape, self._conv_dtype = tuple(conv.shape[1:]), conv.dtype
        self._ssm_shape, self._ssm_dtype = tuple(ssm.shape[1:]), ssm.dtype
        self.device, self.rows = conv.device, rows
        self._buffers: dict[Hashable, Staged] = {}

    def views(self, role: Hashable, rows: int, tokens: int) -> Staged:
        """[rows, tokens, L, ...] views of the role's buffer (grown first if it is smaller)."""
        buf = self._buffers.get(role)
        if buf is None or buf.ssm.shape[0] < rows or buf.ssm.shape[1] < tokens:
            have = (0, 0) if buf is None else tuple(buf.ssm.shape[:2])
            shape = (max(rows, self.rows, have[0]), max(tokens, have[1]))
            buf = self._buffers[role] = Staged(
                torch.empty(*shape, *self._conv_shape, dtype=self._conv_dtype, device=self.device),
                torch.empty(*shape, *self._ssm_shape, dtype=self._ssm_dtype, device=self.device))
        return Staged(buf.conv[:rows, :tokens], buf.ssm[:rows, :tokens])

    @property
    def nbytes(self) -> int:
        """Bytes the current buffers take (metrics, tests)."""
        return sum(t.numel() * t.element_size() for b in self._buffers.values() for t in b)
