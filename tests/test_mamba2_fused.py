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


@pytest.mark.parametrize("backend", ["fused", "torch"])
def test_states_read_through_slots_and_written_into_strided_views(backend: str) -> None:
    """A static step's layout (specialists/staged_states.py): the input states are rows `slots` of a
    cache layer's view (rows strided by the layers), and the states after each token go into views of
    a [rows, tokens, layers, ...] buffer (rows and tokens strided), the padding tokens and rows of the
    buffer untouched; the outputs and states equal a call on contiguous copies bit for bit."""
    p = _params(13, 1, True, torch.bfloat16)
    g = torch.Generator().manual_seed(9)
    B, q, L, layer = 2, 3, 3, 1
    u = torch.randn(B, q, 24, generator=g).to(torch.bfloat16)
    cache_conv = torch.randn(5, L, p.conv_dim, 3, generator=g).to(torch.bfloat16)  # [slots, L, ...]
    cache_ssm = torch.randn(5, L, 4, 8, 16, generator=g) * 0.2
    slots = torch.tensor([3, 0])
    buf_conv = torch.full((4, 5, L, p.conv_dim, 3), -7.0).to(torch.bfloat16)  # [rows, tokens, L, ...]
    buf_ssm = torch.full((4, 5, L, 4, 8, 16), -7.0)
    out = (buf_conv[:B, :q, layer], buf_ssm[:B, :q, layer])
    step = mamba2_step_fused if backend == "fused" else lambda *a, **k: mamba2_multi_step(*a, backend="torch", **k)
    y, convs, states = step(p, u, cache_conv[:, layer], cache_ssm[:, layer], slots=slots, out=out)
    ry, rconvs, rstates = step(p, u, cache_conv[slots, layer].contiguous(), cache_ssm[slots, layer].contiguous())
    assert convs.data_ptr() == out[0].data_ptr() and states.data_ptr() == out[1].data_ptr()
    assert torch.equal(y, ry) and torch.equal(convs, rconvs) and torch.equal(states, rstates)
    written = torch.zeros(4, 5, L, dtype=torch.bool)
    written[:B, :q, layer] = True
    assert (buf_ssm[~written] == -7.0).all() and (buf_conv[~written] == -7.0).all()
    with pytest.raises(ValueError, match="out"):  # a view whose tokens are not contiguous states
        mamba2_step_fused(p, u, cache_conv[:, layer], cache_ssm[:, layer], slots=slots,
                          out=(buf_conv[:B, :q, layer], torch.zeros(B, q, 4, 16, 8).transpose(-1, -2)))


@torch.no_grad()  # exact_linear on CPU: oneDNN's packed product, row-invariant as `mma` is on the GPU
def test_a_mamba_layer_carries_its_residual_add_in_out_proj() -> None:
    """mamba2_layer_fused (a hybrid's Mamba layer on the CUDA decode path): h += mixer(u) in place, the
    add in out_proj's epilogue. Equal to h + the fused step's output to fp32 rounding (the interpreter's
    dots are fp32; on the GPU it runs in bf16, checked by the CUDA engine tests), the same states bit for
    bit; a row's result does not depend on the rows beside it; a 4-token verify's outputs and states are
    those of 4 one-token decodes, bit for bit."""
    from specialists.ops.mamba2_fused import mamba2_layer_fused

    p = _params(17, 1, True, torch.float32)
    g = torch.Generator().manual_seed(21)
    B, q = 3, 4
    h0 = torch.randn(B * q, 24, generator=g)
    u = torch.randn(B * q, 24, generator=g)
    conv = torch.randn(B, p.conv_dim, 3, generator=g) * 0.5
    state = torch.randn(B, 4, 8, 16, generator=g) * 0.2

    def layer(h: torch.Tensor, x: torch.Tensor, rows: int, toks: int, c: torch.Tensor, s: torch.Tensor):
        out = (torch.empty(rows, toks, p.conv_dim, 3), torch.empty(rows, toks, 4, 8, 16))
        h = h.clone()
        assert mamba2_layer_fused(p, x, h, rows, toks, c, s, None, out) is None
        return h, out

    h, (convs, states) = layer(h0, u, B, q, conv, state)
    ry, rconvs, rstates = mamba2_step_fused(p, u.view(B, q, -1), conv, state)
    torch.testing.assert_close(h, h0 + ry.reshape(B * q, -1), atol=1e-5, rtol=1e-5)
    assert torch.equal(states, rstates) and torch.equal(convs, rconvs)
    rows = lambda t: t.view(B, q, -1)  # noqa: E731
    one, (c1, s1) = layer(rows(h0)[1], rows(u)[1], 1, q, conv[1:2], state[1:2])  # row 1 alone
    assert torch.equal(one, rows(h)[1]) and torch.equal(s1[0], states[1]) and torch.equal(c1[0], convs[1])
    c, s = conv, state
    for t in range(q):  # one token at a time: a plain decode's steps
        ht, (ct, st) = layer(rows(h0)[:, t].contiguous(), rows(u)[:, t].contiguous(), B, 1, c, s)
        assert torch.equal(ht, rows(h)[:, t]) and torch.equal(st[:, 0], states[:, t])
        c, s = ct[:, 0], st[:, 0]
