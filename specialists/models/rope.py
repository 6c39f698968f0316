"""Rotary position embedding (RoPE, rotate-half convention), one implementation for every model:

* `rope_inv_freq(theta, dim, device)` -> [dim / 2] the default frequencies 1 / theta^(2i / dim);
* `rope_cos_sin(positions, inv_freq, dtype, scaling)` -> cos, sin [..., 2 * len(inv_freq)];
* `apply_rope(x, cos, sin)` rotates the first R = cos.shape[-1] channels of x (partial rotary keeps
  the rest), x * cos + rotate_half(x) * sin;
* `signed_rope_table(inv_freq, n, dtype)` -> [n, 2, 1, hd] the same as one table per position (cos,
  then sin with rotate-half's sign folded in) and `apply_signed_rope(x, cs)`, which rotates with it
  as x * cos + roll(x, hd / 2) * signed_sin (a sign flip is exact, so the result is the same, in two
  fewer ops; the drafter's fused q/k/v kernel reads this table).

Users: models/llama.py and models/bamba.py (`Rope`), models/mtp.py (`rotary`, the dense drafter
reference and its training), tests/test_fused_kernels.py; the paged drafter (specialists/drafter.py)
keeps its own copy until the engine redesign (issue 15) switches it to these.
"""

from __future__ import annotations

import torch


def rope_inv_freq(theta: float, dim: int, device: str | torch.device | None = None) -> torch.Tensor:
    """-> [dim / 2] float32: 1 / theta^(2i / dim), computed on `device`."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                 scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] (any integer or float dtype), inv_freq [R / 2] -> cos, sin [..., R] in `dtype`,
    each times `scaling` (transformers' attention_scaling; 1.0 for the default RoPE)."""
    freqs = positions.float()[..., None] * inv_freq  # [..., R / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    if scaling == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D], cos / sin broadcastable to [..., R] with R <= D -> x with its first R channels
    rotated (rotate-half), the other D - R unchanged."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
    out = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, xp), dim=-1) if xp.shape[-1] else out


def signed_rope_table(inv_freq: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """-> [n, 2, 1, hd] for positions 0..n-1 (hd = 2 * len(inv_freq)): cos, and sin with its first
    half negated (rotate-half's sign), on inv_freq's device, in `dtype`."""
    angles = torch.arange(n, device=inv_freq.device, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)
    sin = emb.sin()
    sin[:, : emb.shape[-1] // 2].neg_()
    return torch.stack([emb.cos(), sin], dim=1)[:, :, None].to(dtype)


def apply_signed_rope(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd], cs [T, 2, 1, hd] (rows of `signed_rope_table`) -> x rotated at those positions."""
    return x * cs[:, 0] + x.roll(x.shape[-1] // 2, -1) * cs[:, 1]
