"""Mamba2 (Bamba) mixer for inference: a torch reference, with mamba-ssm's Triton scan on CUDA.

The oracle is transformers' ``BambaMixer`` (models/bamba/modeling_bamba.py). Per layer:

    zxbcdt = in_proj(u)                       -> gate z [d_inner], xBC [conv_dim], dt [H]
    xBC    = silu(causal depthwise conv1d(xBC))  (kernel d_conv, bias; conv state = last d_conv-1 inputs)
    x, B, C = split(xBC, [d_inner, G*N, G*N])   head h reads group h // (H // G)
    dt     = clamp(softplus(dt + dt_bias), *time_step_limit);  A = -exp(A_log)
    state_h <- exp(dt*A_h) * state_h + dt * x_h (outer) B       [P, N] per head, fp32
    y_h    = state_h @ C + D_h * x_h
    out    = out_proj(RMSNorm_grouped(y * silu(z)) * norm_weight)

Entry points (all fp32 state, no Python loop over tokens):

* ``mamba2_prefill(p, u[T, d], conv_state, ssm_state)``: one sequence, continuing from its states
  (None = zeros). CPU: a chunked SSD scan (intra-chunk [L, L] decay matrices, inter-chunk
  recurrence as one [nc+1, nc+1] decay matrix). CUDA with mamba-ssm: ``mamba_chunk_scan_combined``
  with ``initial_states`` / ``return_final_states``.
* ``mamba2_multi_step`` / ``mamba2_verify`` (mamba2_steps.py): q new tokens per sequence (q = 1 is
  decode, q = K+1 the speculative verify) in closed form: cumulative log-decays and a [q, q]
  lower-triangular decay matrix per head, so that the caller (state/ssm_cache.py) can commit any
  accepted prefix.

``Mamba2Params`` holds the weights, built from a ``BambaMixer`` (``from_hf``) or from a state dict
plus a BambaConfig (``from_state_dict``). mamba_ssm is never imported on CPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from specialists.ops.linear import exact_linear
from specialists.ops.mamba2_boundaries import states_at

__all__ = [
    "Mamba2Params",
    "mamba2_prefill",
    "mamba2_prefill_at",
    "segsum",
]


@dataclass
class Mamba2Params:
    in_proj_weight: torch.Tensor  # [d_inner + conv_dim + H, d]
    in_proj_bias: torch.Tensor | None
    conv_weight: torch.Tensor  # [conv_dim, d_conv]
    conv_bias: torch.Tensor | None  # [conv_dim]
    dt_bias: torch.Tensor  # [H]
    A_log: torch.Tensor  # [H]
    D: torch.Tensor  # [H]
    norm_weight: torch.Tensor  # [d_inner]
    out_proj_weight: torch.Tensor  # [d, d_inner]
    out_proj_bias: torch.Tensor | None
    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    d_conv: int
    chunk_size: int
    norm_eps: float
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    folded_norm_eps: float | None = None  # the layer's input RMSNorm eps once its gain is in in_proj_weight

    def __post_init__(self) -> None:
        if self.d_inner != self.num_heads * self.head_dim:
            raise ValueError(f"d_inner {self.d_inner} != num_heads*head_dim {self.num_heads * self.head_dim}")
        if self.num_heads % self.n_groups:
            raise ValueError("num_heads must be a multiple of n_groups")
        if tuple(self.conv_weight.shape) != (self.conv_dim, self.d_conv):
            raise ValueError(f"conv weight {tuple(self.conv_weight.shape)} != {(self.conv_dim, self.d_conv)}")
        if self.in_proj_weight.shape[0] != self.d_inner + self.conv_dim + self.num_heads:
            raise ValueError("in_proj rows != d_inner + conv_dim + num_heads")
        lo, hi = self.time_step_limit
        self.time_step_limit = (float(lo), float(hi))

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def d_inner(self) -> int:
        return self.norm_weight.shape[0]

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def hidden_size(self) -> int:
        return self.in_proj_weight.shape[1]

    @property
    def A(self) -> torch.Tensor:
        """A = -exp(A_log), fp32 [H]."""
        return -torch.exp(self.A_log.float())

    # -- constructors --------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, mixer: Any) -> "Mamba2Params":
        """From a transformers ``BambaMixer`` (weights are shared, not copied)."""
        geometry = SimpleNamespace(
            hidden_act=getattr(mixer, "activation", "silu"), mamba_n_heads=mixer.num_heads, mamba_d_head=mixer.head_dim,
            mamba_n_groups=mixer.n_groups, mamba_d_state=mixer.ssm_state_size, mamba_d_conv=mixer.conv_kernel_size,
            mamba_chunk_size=mixer.chunk_size, rms_norm_eps=mixer.norm.variance_epsilon, time_step_limit=mixer.time_step_limit,
        )
        return cls.from_state_dict(mixer.state_dict(), geometry)

    @classmethod
    def from_state_dict(cls, sd: Mapping[str, torch.Tensor], config: Any, prefix: str = "") -> "Mamba2Params":
        """From a mixer's state dict (keys ``in_proj.weight``, ``conv1d.weight``, ... under
        ``prefix``, e.g. ``model.layers.0.mamba.``) and a BambaConfig."""
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"only silu is supported, got {config.hidden_act!r}")

        def get(name: str) -> torch.Tensor | None:
            t = sd.get(prefix + name)
            return None if t is None else t.detach()

        conv_w = get("conv1d.weight")
        return cls(
            in_proj_weight=get("in_proj.weight"),
            in_proj_bias=get("in_proj.bias"),
            conv_weight=conv_w.squeeze(1) if conv_w.dim() == 3 else conv_w,
            conv_bias=get("conv1d.bias"),
            dt_bias=get("dt_bias"),
            A_log=get("A_log"),
            D=get("D"),
            norm_weight=get("norm.weight"),
            out_proj_weight=get("out_proj.weight"),
            out_proj_bias=get("out_proj.bias"),
            num_heads=config.mamba_n_heads,
            head_dim=config.mamba_d_head,
            n_groups=config.mamba_n_groups,
            d_state=config.mamba_d_state,
            d_conv=config.mamba_d_conv,
            chunk_size=config.mamba_chunk_size,
            norm_eps=config.rms_norm_eps,
            time_step_limit=tuple(config.time_step_limit),
        )


# ---------------------------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------------------------


def segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., T] -> S [..., T, T] with S[i, j] = a[j+1] + ... + a[i] for j <= i, -inf above the
    diagonal. Built from masked cumulative sums (no differences of large prefix sums), so
    exp(S) is the exact lower-triangular decay matrix."""
    T = a.shape[-1]
    x = a[..., :, None].expand(*a.shape, T)  # x[k, j] = a[k]
    not_strict, upper = _tri_masks(T, a.device)
    x = x.masked_fill(not_strict, 0.0)  # keep k > j
    s = torch.cumsum(x, dim=-2)  # s[i, j] = sum_{j < k <= i} a[k]
    return s.masked_fill(upper, -math.inf)


@functools.lru_cache(maxsize=64)
def _tri_masks(T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, T] bool: (not strictly lower, strictly upper) -- built once per size and device."""
    ones = torch.ones(T, T, dtype=torch.bool, device=device)
    return ~torch.tril(ones, diagonal=-1), ~torch.tril(ones, diagonal=0)


def _in_proj(p: Mamba2Params, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """in_proj, split into (z, xBC, dt). On CPU in fp32 this is oneDNN on a packed weight
    (specialists/ops/linear.py), whose rows do not depend on the batch shape: BLAS picked different
    kernels (and summation orders) for a 6-row verify batch than for a 300-row prefill, which moved
    the projected xBC -- i.e. the conv state, a copy of it -- by 2-3 fp32 ulps. Row-invariant (on
    CPUs without AMX, see linear.py), a committed conv state equals a fresh prefill's bit for bit.
    This replaced an fp64 product for the xBC rows."""
    zxbcdt = exact_linear(u, p.in_proj_weight, p.in_proj_bias)
    return zxbcdt.split([p.d_inner, p.conv_dim, p.num_heads], dim=-1)


_SMALL_CONV = 16  # new tokens per sequence up to which the conv is computed tap by tap


def _conv(p: Mamba2Params, xbc: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """xbc [B, T, conv_dim], conv_state [B, conv_dim, K-1] -> (silu(conv) [B, T, conv_dim],
    window [B, conv_dim, K-1+T] = the state followed by the new inputs)."""
    window = torch.cat([conv_state.to(xbc.dtype), xbc.transpose(1, 2)], dim=-1)
    w = p.conv_weight.to(xbc.dtype)
    b = None if p.conv_bias is None else p.conv_bias.to(xbc.dtype)
    T = xbc.shape[1]
    if T <= _SMALL_CONV:  # decode / verify: a few taps by hand beat conv1d's set-up cost (~5x on CPU)
        out = (window.unfold(-1, p.d_conv, 1) * w[:, None, :]).sum(-1)  # [B, conv_dim, T]
        if b is not None:
            out = out + b[:, None]
    else:
        out = F.conv1d(window, w.unsqueeze(1), b, groups=p.conv_dim)  # [B, conv_dim, T]
    return F.silu(out).transpose(1, 2), window


def _dt(p: Mamba2Params, dt_raw: torch.Tensor) -> torch.Tensor:
    dt = F.softplus(dt_raw + p.dt_bias.to(dt_raw.dtype))
    lo, hi = p.time_step_limit
    return torch.clamp(dt, min=lo, max=hi).float()


def _split_xbc(p: Mamba2Params, xbc: torch.Tensor):
    """xbc [..., conv_dim] -> x [..., H, P], B [..., H, N], C [..., H, N] (fp32; groups expanded
    to heads)."""
    x, Bg, Cg = xbc.float().split([p.d_inner, p.n_groups * p.d_state, p.n_groups * p.d_state], dim=-1)
    lead = x.shape[:-1]
    x = x.reshape(*lead, p.num_heads, p.head_dim)
    rep = p.num_heads // p.n_groups
    Bh = Bg.reshape(*lead, p.n_groups, p.d_state).repeat_interleave(rep, dim=-2)
    Ch = Cg.reshape(*lead, p.n_groups, p.d_state).repeat_interleave(rep, dim=-2)
    return x, Bh, Ch


def _gated_norm_out(p: Mamba2Params, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [..., d_inner] fp32, z gate -> out_proj(RMSNorm_grouped(y * silu(z)))."""
    h = y.float() * F.silu(z.float())
    lead = h.shape[:-1]
    g = h.view(*lead, p.n_groups, p.d_inner // p.n_groups)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + p.norm_eps)
    h = p.norm_weight * g.view(*lead, p.d_inner).to(dtype)
    return exact_linear(h.to(dtype), p.out_proj_weight, p.out_proj_bias)


def _zeros_states(p: Mamba2Params, batch: tuple[int, ...], device, dtype):
    conv = torch.zeros(*batch, p.conv_dim, p.d_conv - 1, device=device, dtype=dtype)
    ssm = torch.zeros(*batch, p.num_heads, p.head_dim, p.d_state, device=device, dtype=torch.float32)
    return conv, ssm


# ---------------------------------------------------------------------------------------------
# prefill
# ---------------------------------------------------------------------------------------------


def _ssd_chunked(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bh: torch.Tensor, Ch: torch.Tensor,
    D: torch.Tensor, init: torch.Tensor, chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan of one sequence, fp32.

    x [T, H, P], dt [T, H], A [H], Bh/Ch [T, H, N], D [H], init [H, P, N] -> (y [T, H, P], final
    state [H, P, N]). Zero-padding to whole chunks is exact: a padded token has dt = 0 (no decay,
    no input)."""
    T, H, P = x.shape
    N = Bh.shape[-1]
    pad = (-T) % chunk
    if pad:
        x, dt, Bh, Ch = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (x, dt, Bh, Ch))
    nc = x.shape[0] // chunk
    xdt = (x * dt[..., None]).view(nc, chunk, H, P)
    Bc = Bh.view(nc, chunk, H, N)
    Cc = Ch.view(nc, chunk, H, N)
    a = (dt * A).view(nc, chunk, H).permute(0, 2, 1)  # [nc, H, L] log-decay per token
    cum = torch.cumsum(a, dim=-1)  # [nc, H, L]

    # 1. within each chunk: y_l += sum_{s<=l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s
    decay = torch.exp(segsum(a))  # [nc, H, L, L]
    scores = torch.einsum("clhn,cshn->chls", Cc, Bc) * decay
    y = torch.einsum("chls,cshp->clhp", scores, xdt)

    # 2. each chunk's own contribution to the state at its end (starting from zero)
    to_end = torch.exp(cum[..., -1:] - cum)  # [nc, H, L]
    own = torch.einsum("chl,clhn,clhp->chpn", to_end, Bc, xdt)  # [nc, H, P, N]

    # 3. states at chunk starts: start[c] = exp(total[c-1]) start[c-1] + own[c-1], start[0] = init,
    #    as one [nc+1, nc+1] lower-triangular decay matrix over chunks.
    total = F.pad(cum[..., -1].transpose(0, 1), (1, 0))  # [H, nc+1], total[:, 0] = 0
    chunk_decay = torch.exp(segsum(total))  # [H, nc+1, nc+1]
    states = torch.cat([init[None].float(), own], dim=0)  # [nc+1, H, P, N]
    starts = torch.einsum("hcz,zhpn->chpn", chunk_decay, states)  # [nc+1, H, P, N]
    final = starts[-1]

    # 4. the chunk start state seen from each position: y_l += exp(cum_l) C_l . start
    y = y + torch.einsum("clhn,chpn->clhp", Cc, starts[:-1]) * torch.exp(cum).permute(0, 2, 1)[..., None]
    y = y.reshape(nc * chunk, H, P)[:T] + D.float()[:, None] * x[:T]
    return y, final


def _use_triton(device: torch.device):
    if device.type != "cuda":
        return None
    from specialists.ops.mamba_ssm_triton import load_triton_ssd  # imports mamba_ssm only on CUDA

    return load_triton_ssd()


def triton_scan(ops, p: Mamba2Params, xbc: torch.Tensor, dt: torch.Tensor, init: torch.Tensor,
                raw_dt: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """mamba-ssm's Triton chunk scan over rows xbc [B, n, conv_dim] (after the conv), dt [B, n, H] from
    init [B, H, P, N] fp32 -> (y [B, n, H, P] fp32 with the D skip, final states [B, H, P, N] fp32);
    raw_dt: dt before its bias, softplus and limits (the scan applies them), else as given."""
    B, n = xbc.shape[:2]
    xs, Bg, Cg = xbc.split([p.d_inner, p.n_groups * p.d_state, p.n_groups * p.d_state], dim=-1)
    how = dict(dt_bias=p.dt_bias, dt_softplus=True, dt_limit=p.time_step_limit) if raw_dt else dict(dt_bias=None, dt_softplus=False)
    y, final = ops.chunk_scan_combined(
        xs.reshape(B, n, p.num_heads, p.head_dim), dt, p.A, Bg.reshape(B, n, p.n_groups, p.d_state),
        Cg.reshape(B, n, p.n_groups, p.d_state), p.chunk_size, D=p.D, z=None, initial_states=init,
        return_final_states=True, **how)
    return y.float(), final.float()


def mamba2_prefill(
    p: Mamba2Params,
    u: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    ssm_state: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence u [T, d], continuing from conv_state [conv_dim, K-1] and ssm_state [H, P, N]
    (None = zeros). Returns (y [T, d], conv_state [conv_dim, K-1], ssm_state [H, P, N] fp32).

    backend: "auto" (Triton chunk scan on CUDA when mamba-ssm loads, else torch), "torch", "triton".
    The inputs are not modified."""
    return _prefill(p, u, conv_state, ssm_state, (), backend)[:3]


def mamba2_prefill_at(
    p: Mamba2Params,
    u: torch.Tensor,
    conv_state: torch.Tensor | None,
    ssm_state: torch.Tensor | None,
    at: Sequence[int],
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """mamba2_prefill that also returns the states after the first n tokens of u, for each n in `at`
    (increasing, 1 <= n <= T): (y, conv_state, ssm_state, conv_at [len(at), conv_dim, K-1], ssm_at
    [len(at), H, P, N] fp32). The prefix cache snapshots a hybrid's state at block boundaries with it
    (state/ssm_snapshots.py); specialists/ops/mamba2_boundaries.py computes them from the prefill's
    inputs, beside the scan (torch or Triton)."""
    at = [int(n) for n in at]
    if not at or at != sorted(set(at)) or at[0] < 1 or at[-1] > u.shape[0]:
        raise ValueError(f"at must be increasing token counts in [1, {u.shape[0]}], got {at}")
    return _prefill(p, u, conv_state, ssm_state, at, backend)


def _prefill(
    p: Mamba2Params, u: torch.Tensor, conv_state: torch.Tensor | None, ssm_state: torch.Tensor | None,
    at: Sequence[int], backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    if u.dim() != 2:
        raise ValueError(f"u must be [T, d], got {tuple(u.shape)}")
    T = u.shape[0]
    if T == 0:
        raise ValueError("empty prefill")
    ops = None
    if backend == "triton" or (backend == "auto" and u.is_cuda):
        ops = _use_triton(u.device)
        if ops is None and backend == "triton":
            raise RuntimeError("Triton SSD ops are unavailable")
    z0, s0 = _zeros_states(p, (), u.device, u.dtype)
    conv_state = z0 if conv_state is None else conv_state
    ssm_state = s0 if ssm_state is None else ssm_state

    z, xbc, dt_raw = _in_proj(p, u)
    xbc, window = _conv(p, xbc[None], conv_state[None])
    K1 = p.d_conv - 1
    new_conv = window[0, :, -K1:].to(conv_state.dtype).clone()
    conv_at = torch.stack([window[0, :, n:n + K1] for n in at]).to(conv_state.dtype) if at else None
    xbc = xbc[0]

    ssm_at = None
    if ops is not None:
        y, final = triton_scan(ops, p, xbc[None], dt_raw[None], ssm_state[None].float(), raw_dt=True)
        y, final = y[0], final[0]
    if ops is None or at:
        x, Bh, Ch = _split_xbc(p, xbc)
        dt = _dt(p, dt_raw)
    if ops is None:
        chunk = min(p.chunk_size, T)  # a short prefill is one chunk of its own length, not padded to 128
        y, final = _ssd_chunked(x, dt, p.A, Bh, Ch, p.D, ssm_state, chunk)
    if at:
        ssm_at = states_at(x * dt[..., None], dt * p.A, Bh, ssm_state, at)

    out = _gated_norm_out(p, y.reshape(T, p.d_inner), z, u.dtype)
    return out, new_conv, final.contiguous(), conv_at, ssm_at
