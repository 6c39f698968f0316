"""The Mamba2 mixer over q new tokens per sequence (decode: q = 1, verify: q = K+1), for sequences
whose conv and SSM states sit in an SSMCache. The prefill and the shared pieces (in_proj, conv,
gated norm) are in mamba2.py.

  mamba2_multi_step: outputs and the states after each of the q tokens (the reference; decodes).
  mamba2_verify:     the same outputs, the SSM states as StateFactors, from which commit builds only
                     the state after the accepted prefix (the engine's verifies).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from specialists.ops.mamba2 import Mamba2Params, _conv, _dt, _gated_norm_out, _in_proj, _split_xbc, _use_triton, segsum

__all__ = ["fused_mamba", "fused_mamba_layers", "mamba2_multi_step", "mamba2_verify", "StateFactors"]


def fused_mamba(device: torch.device) -> bool:
    """The fused step (mamba2_fused.py) on this device: CUDA, and CANTATA_FUSED_MAMBA not 0 (A/B runs)."""
    return device.type == "cuda" and os.environ.get("CANTATA_FUSED_MAMBA", "1") != "0"


def fused_mamba_layers(device: torch.device) -> bool:
    """A hybrid's Mamba layers on the decode path carry their residual add in out_proj
    (mamba2_fused.mamba2_layer_fused): fused_mamba, and CANTATA_FUSED_MAMBA_LAYER not 0 (A/B runs)."""
    return fused_mamba(device) and os.environ.get("CANTATA_FUSED_MAMBA_LAYER", "1") != "0"


@dataclass
class _Step:
    z: torch.Tensor  # [B, q, d_inner] gate
    conv_states: torch.Tensor  # [B, q, conv_dim, K-1] conv state after each token
    x: torch.Tensor  # [B, q, H, P]
    Bh: torch.Tensor  # [B, q, H, N]
    Ch: torch.Tensor  # [B, q, H, N]
    dt: torch.Tensor  # [B, q, H]
    xdt: torch.Tensor  # [B, q, H, P]


def _step_inputs(p: Mamba2Params, u: torch.Tensor, conv_state: torch.Tensor) -> _Step:
    """u [B, q, d], conv_state [B, conv_dim, K-1] -> the projected, convolved inputs of q tokens."""
    if u.dim() != 3:
        raise ValueError(f"u must be [B, q, d], got {tuple(u.shape)}")
    K1 = p.d_conv - 1
    z, xbc, dt_raw = _in_proj(p, u)
    xbc, window = _conv(p, xbc, conv_state)  # window [B, conv_dim, K-1+q]
    # state after token t = the K-1 inputs ending at t: window[..., t+1 : t+K]
    conv_states = window.unfold(-1, K1, 1)[:, :, 1:].permute(0, 2, 1, 3).to(conv_state.dtype).contiguous()
    x, Bh, Ch = _split_xbc(p, xbc)
    dt = _dt(p, dt_raw)
    return _Step(z, conv_states, x, Bh, Ch, dt, x * dt[..., None])


def _decays(p: Mamba2Params, dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dt [B, q, H] -> (from_start [B, H, q] = exp(a_0 + ... + a_t), decay [B, H, q, q] = exp(segsum(a)))."""
    a = (dt * p.A).transpose(1, 2)
    return torch.exp(torch.cumsum(a, dim=-1)), torch.exp(segsum(a))


def mamba2_multi_step(
    p: Mamba2Params,
    u: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    backend: str = "auto",
    slots: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q new tokens for each of B sequences. backend "auto": on CUDA the fused step (mamba2_fused.py:
    two Triton kernels, each token a decode's recurrence; CANTATA_FUSED_MAMBA=0: off), else a plain
    decode (q = 1) on CUDA runs mamba-ssm's selective_state_update when it loads; "torch": the
    reference below.

    u [B, q, d], conv_state [B, conv_dim, K-1], ssm_state [B, H, P, N] fp32 ->
    (y [B, q, d], conv_states [B, q, conv_dim, K-1], ssm_states [B, q, H, P, N] fp32), where
    conv_states[:, t] / ssm_states[:, t] are the states after token t (0-based). The inputs are
    not modified. `slots` [B] (device): the input states are rows slots[b] of conv_state / ssm_state (a
    cache's layer views); `out` (conv [B, q, ...], ssm [B, q, ...] views): the states are written there
    and returned (a static batch's staged states, specialists/staged_states.py).

    Closed form over q: with a_t = dt_t A_h and S = segsum(a) ([q, q] per head),
        state_t = exp(a_0 + ... + a_t) state_in + sum_{s<=t} exp(S[t, s]) dt_s x_s (outer) B_s
        y_t = state_t . C_t + D x_t
    """
    if backend == "auto" and u.dim() == 3 and fused_mamba(u.device):
        from specialists.ops.mamba2_fused import mamba2_step_fused  # two Triton kernels, a recurrence per token

        return mamba2_step_fused(p, u, conv_state, ssm_state, slots, out)
    if slots is not None:
        conv_state, ssm_state = conv_state.index_select(0, slots), ssm_state.index_select(0, slots)
    y, convs, states = _multi_step(p, u, conv_state, ssm_state, backend)
    if out is None:
        return y, convs, states
    out[0].copy_(convs)
    out[1].copy_(states)
    return y, out[0], out[1]


def _multi_step(p: Mamba2Params, u: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mamba2_multi_step without the fused kernels (torch, or mamba-ssm's decode kernel)."""
    st = _step_inputs(p, u, conv_state)
    Bsz, q = u.shape[:2]
    ssu = _use_triton(u.device) if q == 1 and backend == "auto" else None
    if ssu is not None:
        return _decode_fused(p, st, ssm_state, ssu.selective_state_update, u.dtype)
    if q == 1:  # plain decode: state = exp(dt A) state + dt x (outer) B, no segment sums
        decay1 = torch.exp(st.dt[:, 0] * p.A)[..., None, None]  # [B, H, 1, 1]
        states = torch.addcmul(decay1 * ssm_state.float(), st.xdt[:, 0, :, :, None], st.Bh[:, 0, :, None, :])[:, None]  # [B, 1, H, P, N]
    else:
        from_start, decay = _decays(p, st.dt)
        H, P, N = p.num_heads, p.head_dim, p.d_state
        xb = (st.xdt[..., :, None] * st.Bh[..., None, :]).permute(0, 2, 1, 3, 4).reshape(Bsz, H, q, P * N)  # [B, H, q, P*N]
        states = (decay @ xb).view(Bsz, H, q, P, N).transpose(1, 2)  # [B, q, H, P, N]: one batched matmul
        states = states + from_start.transpose(1, 2)[..., None, None] * ssm_state.float()[:, None]
    y = (states @ st.Ch[..., :, None])[..., 0] + p.D.float()[:, None] * st.x
    out = _gated_norm_out(p, y.reshape(Bsz, q, p.d_inner), st.z, u.dtype)
    return out, st.conv_states, states


def _decode_fused(p: Mamba2Params, st: _Step, ssm_state: torch.Tensor, update, dtype: torch.dtype):
    """One token per sequence through mamba-ssm's kernel, on a copy of the state (the cache is only
    written at commit): the same math as the torch decode (dt already softplus'd and clamped)."""
    Bsz, H, P, N = ssm_state.shape
    state = ssm_state.float().clone()  # [B, H, P, N], updated in place by the kernel
    zero_bias = st.dt.new_zeros(1, 1).expand(H, P)  # dt is final already; stride-0 dt / A / bias: one dt per head
    y = update(state, st.x[:, 0], st.dt[:, 0, :, None].expand(Bsz, H, P), p.A.float()[:, None, None].expand(H, P, N),
               st.Bh[:, 0], st.Ch[:, 0], D=p.D.float()[:, None].expand(H, P), dt_bias=zero_bias,
               dt_softplus=False)  # [B, H, P] fp32
    out = _gated_norm_out(p, y.reshape(Bsz, 1, p.d_inner), st.z, dtype)
    return out, st.conv_states, state[:, None]


@dataclass
class StateFactors:
    """What the SSM state after any prefix of a verify's q tokens is made of, without the q states
    themselves: state after token t = from_start[t] * ssm_in + sum_s decay[t, s] * xdt_s (outer) B_s."""

    ssm_in: torch.Tensor  # [B, H, P, N] fp32, the state before the q tokens
    from_start: torch.Tensor  # [B, H, q] exp(a_0 + ... + a_t)
    decay: torch.Tensor  # [B, H, q, q] exp(segsum(a)), zero above the diagonal
    xdt: torch.Tensor  # [B, q, H, P]
    Bh: torch.Tensor  # [B, q, H, N]

    def rows(self, n: int) -> "StateFactors":
        """The factors of the first n sequences."""
        return StateFactors(self.ssm_in[:n], self.from_start[:n], self.decay[:n], self.xdt[:n], self.Bh[:n])

    @property
    def q(self) -> int:
        return int(self.from_start.shape[-1])

    def state_after(self, rows: torch.Tensor | slice, t: torch.Tensor | int) -> torch.Tensor:  # -> [n, H, P, N]
        """The state after token t[i] (0-based) of sequence rows[i] (rows, t [n]; or one sequence as
        rows = slice(r, r + 1) and t an int, with no index tensors)."""
        w = self.decay[rows, :, t, :]  # [n, H, q]: weight of each token's input at position t
        xw = self.xdt[rows] * w.transpose(1, 2)[..., None]  # [n, q, H, P]
        added = xw.permute(0, 2, 3, 1) @ self.Bh[rows].transpose(1, 2)  # [n, H, P, q] @ [n, H, q, N]
        start = self.from_start[rows, :, t]  # [n, H]
        return start[..., None, None] * self.ssm_in[rows] + added


def mamba2_verify(
    p: Mamba2Params,
    u: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, StateFactors]:
    """mamba2_multi_step for a verify: the same outputs and conv states, but the SSM states as
    StateFactors (the state after the accepted prefix is built at commit, one per sequence) and
    the outputs by the quadratic (attention-like) form, y = C_t . state_t without materializing
    [B, q, H, P, N]. u [B, q, d], conv_state [B, conv_dim, K-1], ssm_state [B, H, P, N] fp32."""
    st = _step_inputs(p, u, conv_state)
    Bsz, q = u.shape[:2]
    from_start, decay = _decays(p, st.dt)
    s0 = ssm_state.float()
    C = st.Ch.transpose(1, 2)  # [B, H, q, N]
    from_state = (C @ s0.transpose(-1, -2)) * from_start[..., None]  # [B, H, q, P]
    scores = (C @ st.Bh.permute(0, 2, 3, 1)) * decay  # [B, H, q, q]
    y = (from_state + scores @ st.xdt.transpose(1, 2)).transpose(1, 2) + p.D.float()[:, None] * st.x  # [B, q, H, P]
    out = _gated_norm_out(p, y.reshape(Bsz, q, p.d_inner), st.z, u.dtype)
    return out, st.conv_states, StateFactors(s0, from_start, decay, st.xdt, st.Bh)
