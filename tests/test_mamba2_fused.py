"""The fused Mamba2 step (specialists/ops/mamba2_fused.py) against the torch step (mamba2_steps.py),
through Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1): one token (a decode)
and four (a verify, token by token), one and two groups, with and without a conv bias, fp32 and bf16
activations; the outputs and every token's conv and SSM states agree, and a verify's states after
token t equal t+1 decodes' (the same recurrence)."""

from __future__ import annotations

import os

import pytest
import torch

from specialists.ops.mamba2 import Mamba2Params
from specialists.ops.mamba2_steps import mamba2_multi_step

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1", allow_module_level=True)

from specialists.ops.mamba2_fused import mamba2_step_fused, mixer_step  # noqa: E402 - after the interpreter check


def _params(seed: int, groups: int, bias: bool, dtype: torch.dtype, H: int = 4, P: int = 8, N: int = 16, d: int = 24):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=0.3: (torch.randn(*s, generator=g) * scale).to(dtype)  # noqa: E731
    din, conv_dim = H * P, H * P + 2 * groups * N
    return Mamba2Params(
        in_proj_weight=r(din + conv_dim + H, d), in_proj_bias=None, conv_weight=r(conv_dim, 4, scale=0.5),
        conv_bias=r(conv_dim) if bias else None, dt_bias=r(H), A_log=torch.rand(H, generator=g).to(dtype),
        D=r(H, scale=1.0), norm_weight=(1 + r(din)).to(dtype), out_proj_weight=r(d, din), out_proj_bias=None,
        num_heads=H, head_dim=P, n_groups=groups, d_state=N, d_conv=4, chunk_size=8, norm_eps=1e-5)


@pytest.mark.parametrize("q", [1, 4])
@pytest.mark.parametrize("groups,bias,dtype", [(1, True, torch.float32), (2, False, torch.float32), (1, True, torch.bfloat16)])
def test_fused_step_matches_the_torch_step(q: int, groups: int, bias: bool, dtype: torch.dtype) -> None:
    p = _params(7 + q, groups, bias, dtype)
    g = torch.Generator().manual_seed(3)
    B = 3
    u = torch.randn(B, q, 24, generator=g).to(dtype)
    conv = (torch.randn(B, p.conv_dim, 3, generator=g) * 0.5).to(dtype)
    state = torch.randn(B, 4, 8, 16, generator=g) * 0.2
    y, convs, states = mamba2_step_fused(p, u, conv, state)
    ry, rconvs, rstates = mamba2_multi_step(p, u, conv, state, backend="torch")
    assert y.shape == ry.shape and convs.shape == rconvs.shape and states.shape == rstates.shape
    torch.testing.assert_close(convs, rconvs, atol=0, rtol=0)  # the raw inputs, copied
    if dtype == torch.float32:
        torch.testing.assert_close(states, rstates, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y, ry, atol=1e-5, rtol=1e-5)
    else:  # bf16: the states as torch's (its roundings kept); the output after bf16 products to bf16's precision
        torch.testing.assert_close(states, rstates, atol=1e-5, rtol=1e-5)
        assert ((y.float() - ry.float()).norm() / ry.float().norm()).item() < 1e-2


def test_a_verify_runs_a_decodes_recurrence() -> None:
    """Between the products (the same in_proj rows), a 4-token step's states and outputs equal those
    of 4 one-token steps, bit for bit: each token of a verify runs a decode's instructions."""
    p = _params(11, 1, True, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    B, q = 2, 4
    zx = torch.randn(B * q, p.in_proj_weight.shape[0], generator=g).to(torch.bfloat16)
    conv = torch.randn(B, p.conv_dim, 3, generator=g).to(torch.bfloat16)
    state = torch.randn(B, 4, 8, 16, generator=g) * 0.2
    normed, convs, states = mixer_step(p, zx, B, q, conv, state)
    rows = zx.view(B, q, -1)
    for t in range(q):
        n1, c1, s1 = mixer_step(p, rows[:, t].contiguous(), B, 1, conv, state)
        assert torch.equal(states[:, t], s1[:, 0]) and torch.equal(convs[:, t], c1[:, 0])
        assert torch.equal(normed.view(B, q, -1)[:, t], n1)
        conv, state = c1[:, 0], s1[:, 0]
