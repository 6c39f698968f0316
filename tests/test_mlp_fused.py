"""The MLP step in one kernel (specialists/ops/mlp_fused.py): against the torch ops and the two fused
products it replaces, a row's bits independent of the call, the in-place residual, biases, and the
plan's rules. On CPU through Triton's interpreter in fp32 (the two phases as two launches); with
CANTATA_TEST_DEVICE=cuda compiled in bf16, the barrier between the phases included."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
DEV = os.environ.get("CANTATA_TEST_DEVICE", "cpu")
CUDA = DEV.startswith("cuda")
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1", allow_module_level=True)

from specialists.ops import decode_fused as D  # noqa: E402
from specialists.ops import mlp_fused as MF  # noqa: E402

DT = torch.bfloat16 if CUDA else torch.float32
TOL = 3e-2 if CUDA else 2e-5


def _weights(d: int, ffn: int, seed: int, bias: bool):
    g = torch.Generator(device=DEV).manual_seed(seed)
    gu = (torch.randn(2 * ffn, d, device=DEV, generator=g) / d ** 0.5).to(DT)
    down = (torch.randn(d, ffn, device=DEV, generator=g) / ffn ** 0.5).to(DT)
    gain = (torch.rand(d, device=DEV, generator=g) + 0.5).to(DT)
    b1 = torch.randn(2 * ffn, device=DEV, generator=g).to(DT) if bias else None
    b2 = torch.randn(d, device=DEV, generator=g).to(DT) if bias else None
    return g, gu, down, gain, b1, b2


def _torch_mlp(h, gain, gu, down, b1, b2, eps):
    gate, up = F.linear(F.rms_norm(h, (h.shape[1],), gain, eps), gu, b1).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate) * up, down, b2)


@pytest.mark.parametrize("m,d,ffn,bias", [(1, 96, 80, False), (5, 128, 160, True), (20, 64, 48, False)])
def test_the_fused_mlp_matches_torch_and_the_two_products(m: int, d: int, ffn: int, bias: bool) -> None:
    """d 96: a K tail in the 64-wide blocks; ffn 80 and 48: a program's rows past the ffn (masked), and
    programs with no outputs to sum in phase 2."""
    g, gu, down, gain, b1, b2 = _weights(d, ffn, 3 + m, bias)
    h = torch.randn(m, d, device=DEV, generator=g).to(DT)
    ref = _torch_mlp(h, gain, gu, down, b1, b2, 1e-5)
    out = h.clone()
    assert MF.mlp(out, gain, 1e-5, gu, down, b1, b2) is out
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL, rtol=TOL)
    two = h.clone()
    D.mma(D.mma(h, gu, b1, gain=gain, eps=1e-5), down, b2, swiglu=True, residual=two)
    torch.testing.assert_close(out.float(), two.float(), atol=TOL, rtol=TOL)
    if not bias:  # one bias without the other
        b2 = torch.randn(d, device=DEV, generator=g).to(DT)
        out = h.clone()
        MF.mlp(out, gain, 1e-5, gu, down, None, b2)
        torch.testing.assert_close(out.float(), _torch_mlp(h, gain, gu, down, None, b2, 1e-5).float(), atol=TOL, rtol=TOL)


def test_a_rows_fused_mlp_does_not_depend_on_the_call() -> None:
    """A row alone, in any slot among others and on a second call gives the same bits (the partials
    are summed in one order fixed by the shapes; the counters reset); across tiles of 16 and 64 rows
    the tensor cores agree bit for bit (CUDA), the interpreter's products closely."""
    g, gu, down, gain, _, _ = _weights(128, 192, 11, False)
    x = torch.randn(40, 128, device=DEV, generator=g).to(DT)

    def run(rows):
        return MF.mlp(x[rows].clone(), gain, 1e-6, gu, down)

    tile16, together = run(slice(0, 16)), run(slice(0, 40))
    for i in (0, 7, 15):
        assert torch.equal(run(slice(i, i + 1)), tile16[i:i + 1])
    assert torch.equal(run(slice(3, 9)), tile16[3:9]) and torch.equal(run(slice(0, 40)), together)
    for rows in (slice(0, 16), slice(30, 31)):
        if CUDA:
            assert torch.equal(run(rows), together[rows])
        else:
            torch.testing.assert_close(run(rows), together[rows], atol=1e-6, rtol=1e-6)
    assert int(D.arrival_locks(x.device, 2)[:2].abs().sum()) == 0  # left as found for the next kernel


def test_the_plan_comes_from_the_shapes_alone(monkeypatch) -> None:
    dev = torch.device(DEV)
    p = MF.plan(576, 1536, dev)  # smollm2-135m
    assert p is not None and p.rows == 16 and p.programs == 96 and p.cols * p.programs >= 576
    assert p.programs <= MF._sm_count(dev)
    big = MF.plan(1024, 8192, dev)  # 64 rows a program: 128 programs
    assert big is not None and big.rows == 64 and big.programs == 128
    assert MF.plan(2048, 8192, dev) is None  # wider than MAX_WIDTH: the two products
    assert MF.plan(576, 16384, dev) is None  # more programs than it may have
    monkeypatch.setenv("CANTATA_FUSED_MLP", "0")
    assert MF.plan(576, 1536, dev) is None
    g, gu, down, gain, _, _ = _weights(64, 48, 1, False)
    with pytest.raises(ValueError, match="no fused MLP"):
        MF.mlp(torch.zeros(1, 64, device=DEV, dtype=DT), gain, 1e-5, gu, down)
    monkeypatch.delenv("CANTATA_FUSED_MLP")
    with pytest.raises(ValueError, match="at most"):
        MF.mlp(torch.zeros(D.MAX_ROWS + 1, 64, device=DEV, dtype=DT), gain, 1e-5, gu, down)
    with pytest.raises(ValueError, match="contiguous"):
        MF.mlp(torch.zeros(1, 64, device=DEV, dtype=DT), gain, 1e-5, gu.t().contiguous().t(), down)
