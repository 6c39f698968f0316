"""Prompts' Mamba2 prefills at one padded length (specialists/prefill_graph.py): rows of n tokens, row b
a prompt's lens[b] <= n new tokens (read on the device) followed by padding, from the states in its slot
(zeros for a fresh prompt, a restored snapshot after a prefix hit).

- the padding's dt is 0: no decay and no input, so the state after the n tokens is the state after the
  prompt (the chunked scan's own zero padding rests on the same identity: mamba2._ssd_chunked);
- the conv state after the prompt is its window's K-1 inputs ending at lens[b], gathered on the device;
- the states on the prefix cache's snapshot grid (every `stride` tokens below n: state/ssm_snapshots.py;
  a row starts on it) come from grid_states over the padded tokens; those past a prompt's end are never
  read (a prompt's plan asks only for counts inside it).
Every shape is static, so a CUDA graph per (rows, n) replays it for any lens. The scan is mamba-ssm's
Triton one where it is installed (as an eager prefill's), else the torch one (the chunk is min(chunk_size,
n) where an eager prefill of T tokens takes min(chunk_size, T)): in fp32 its results match an eager
prefill's to rounding, not bit for bit.
"""

from __future__ import annotations

import torch

from specialists.ops.mamba2 import (Mamba2Params, _conv, _dt, _gated_norm_out, _in_proj, _split_xbc, _ssd_chunked,
                                    _use_triton, triton_scan)
from specialists.ops.mamba2_boundaries import grid_states

__all__ = ["mamba2_prefill_padded"]


def mamba2_prefill_padded(p: Mamba2Params, u: torch.Tensor, lens: torch.Tensor, stride: int = 0,
                          conv0: torch.Tensor | None = None, ssm0: torch.Tensor | None = None):
    """u [B, n, d] normed, lens [B] (device), the states before: conv0 [B, conv_dim, K-1], ssm0 [B, H, P, N]
    (None: zeros) -> (y [B * n, d], conv [B, conv_dim, K-1], ssm [B, H, P, N] fp32: the states after each
    prompt, conv_at [B, k, conv_dim, K-1] and ssm_at [B, k, H, P, N] after stride, 2 stride, ..., k stride
    of its tokens with k = (n - 1) // stride (None when k is 0 or stride 0))."""
    B, n, _ = u.shape
    z, xbc, dt_raw = _in_proj(p, u)
    K1 = p.d_conv - 1
    conv0 = xbc.new_zeros(B, p.conv_dim, K1) if conv0 is None else conv0
    xbc, window = _conv(p, xbc, conv0)  # window [B, conv_dim, K-1 + n]
    ends = lens.long()[:, None] + torch.arange(K1, device=u.device)  # window columns of the last K-1 inputs
    conv = window.gather(2, ends[:, None, :].expand(B, p.conv_dim, K1))
    valid = torch.arange(n, device=u.device)[None, :] < lens.long()[:, None]  # [B, n]
    dt = _dt(p, dt_raw) * valid[..., None]  # the padding's dt: 0
    x, Bh, Ch = _split_xbc(p, xbc)  # [B, n, H, P], [B, n, H, N] x2
    k = (n - 1) // stride if stride else 0
    init = torch.zeros(B, p.num_heads, p.head_dim, p.d_state, device=u.device) if ssm0 is None else ssm0.float()
    y, final = _scan(p, x, dt, Bh, Ch, xbc, init)
    out = _gated_norm_out(p, y.reshape(B * n, p.d_inner), z.reshape(B * n, -1), u.dtype)
    if not k:
        return out, conv, final, None, None
    grid = torch.stack([grid_states(x[b] * dt[b][..., None], dt[b] * p.A, Bh[b], init[b], stride, k) for b in range(B)])
    conv_at = torch.stack([window[:, :, j:j + K1] for j in range(stride, k * stride + 1, stride)], dim=1)
    return out, conv, final, conv_at, grid


def _scan(p: Mamba2Params, x: torch.Tensor, dt: torch.Tensor, Bh: torch.Tensor, Ch: torch.Tensor, xbc: torch.Tensor,
          init: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """init [B, H, P, N] -> (y [B, n, H, P] fp32, final states [B, H, P, N]): mamba-ssm's Triton chunk scan over every row at
    once where it loads (dt given as is: masked, softplus and limits applied), else the torch scan a row
    at a time (the graph records each; shapes are static)."""
    B, n = x.shape[:2]
    ops = _use_triton(x.device)
    if ops is not None:
        return triton_scan(ops, p, xbc, dt, init, raw_dt=False)
    ys, finals = zip(*(_ssd_chunked(x[b], dt[b], p.A, Bh[b], Ch[b], p.D, init[b], min(p.chunk_size, n)) for b in range(B)))
    return torch.stack(ys), torch.stack(finals)
