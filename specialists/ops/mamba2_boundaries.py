"""SSM states of one sequence after given token counts (the prefix cache's block boundaries inside a
prefill: specialists/ops/mamba2.py `mamba2_prefill_at`), straight from the prefill's inputs.

With boundaries 0 = n_0 < n_1 < ... < n_k, the state after n_i tokens is
    S_i = exp(a over segment i) * S_{i-1} + sum_{s in segment i} exp(a_{s+1} + ... + a_{n_i}) dt_s x_s (outer) B_s
(a_s = dt_s A, S_0 = the initial state). Each token enters one segment's sum: the segments are padded
at the front to the longest (padding has dt x = 0 and a = 0) and summed in one batched matmul, then
the k states follow by the recurrence over segments (a loop over boundaries, not tokens). The work is
about one pass of dt x (outer) B over the prefill, independent of how many boundaries are asked for.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from state.transfer import device_ints

__all__ = ["grid_states", "states_at"]


def states_at(xdt: torch.Tensor, a: torch.Tensor, Bh: torch.Tensor, init: torch.Tensor,
              at: Sequence[int]) -> torch.Tensor:
    """xdt [T, H, P] (dt * x), a [T, H] (dt * A, log-decays), Bh [T, H, N], init [H, P, N] fp32,
    at: increasing counts in [1, T] -> [len(at), H, P, N] fp32, the state after each count."""
    ends = [int(n) for n in at]
    starts = [0, *ends[:-1]]
    width = max(e - s for s, e in zip(starts, ends))
    # [k, width]: each segment's token positions, front-padded (host lists: no device sync)
    rows = [[max(e - width + t, 0) for t in range(width)] for e in ends]
    mask = [[float(e - width + t >= s) for t in range(width)] for s, e in zip(starts, ends)]
    pos = device_ints(rows, xdt.device)
    valid = device_ints(mask, xdt.device, xdt.dtype)
    return _segment_states(a[pos] * valid[..., None], xdt[pos] * valid[..., None, None], Bh[pos], init)


def grid_states(xdt: torch.Tensor, a: torch.Tensor, Bh: torch.Tensor, init: torch.Tensor, stride: int,
                k: int) -> torch.Tensor:
    """states_at(..., at=[stride, 2 stride, ..., k stride]) by views, no index tensors (a CUDA graph's
    padded prefill, specialists/ops/mamba2_padded.py): the segments are the grid's, all `stride` long."""
    H = a.shape[-1]
    n = k * stride
    return _segment_states(a[:n].view(k, stride, H), xdt[:n].view(k, stride, *xdt.shape[1:]),
                           Bh[:n].view(k, stride, *Bh.shape[1:]), init)


def _segment_states(a_seg: torch.Tensor, xdt_seg: torch.Tensor, B_seg: torch.Tensor, init: torch.Tensor) -> torch.Tensor:
    """a_seg [k, width, H], xdt_seg [k, width, H, P], B_seg [k, width, H, N] (segment i's tokens, the
    padding zero in a and xdt), init [H, P, N] -> [k, H, P, N]: the state at each segment's end."""
    total = a_seg.sum(1)  # [k, H]
    # decay from token s to the segment end, exp(a_{s+1} + ... + a_end), summed from the end: no difference
    # of two large prefix sums (a_s reaches -10 and more per token), so the weights that matter are exact
    after = torch.cat([a_seg[:, 1:], torch.zeros_like(a_seg[:, :1])], dim=1)  # [k, width, H]: a_{s+1}
    to_end = torch.exp(after.flip(1).cumsum(1).flip(1))  # [k, width, H]
    xw = (xdt_seg * to_end[..., None]).permute(0, 2, 3, 1)  # [k, H, P, width]
    own = xw @ B_seg.transpose(1, 2)  # [k, H, P, width] @ [k, H, width, N] -> [k, H, P, N]
    decay = torch.exp(total)[..., None, None]  # [k, H, 1, 1]
    out = []
    state = init.float()
    for i in range(own.shape[0]):
        state = decay[i] * state + own[i]
        out.append(state)
    return torch.stack(out)
