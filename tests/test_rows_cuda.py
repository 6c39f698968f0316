"""specialists/ops/rows_cuda.py: the Triton argmax and multi-step batch rows give torch's answers
(here in Triton's interpreter on CPU tensors; on a GPU with CANTATA_TEST_DEVICE=cuda through the
public functions); the RoPE table gives the computed cos / sin."""

from __future__ import annotations

import os

import pytest
import torch

from specialists.ops import rows_cuda

DEVICE = os.environ.get("CANTATA_TEST_DEVICE", "cpu")


def _kernels_run() -> None:
    pytest.importorskip("triton")
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1 (tests/conftest.py sets it)")


def _argmax(x: torch.Tensor) -> torch.Tensor:
    return rows_cuda.row_argmax(x) if DEVICE == "cuda" else rows_cuda._argmax(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [100, 2048, 5000, 49152])
def test_row_argmax_is_torchs(V, dtype):
    _kernels_run()
    g = torch.Generator().manual_seed(V)
    x = torch.randn(5, V, generator=g).to(DEVICE, dtype)
    x[1] = x[1].round()  # many ties: the first index of the largest value wins
    x[2, V // 3] = x[2, V - 1] = x[2].max() + 1  # a tie across blocks
    x[3] = float("-inf")  # a row masked whole (a grammar's): index 0, as torch
    x[4, V // 2] = float("nan")  # a NaN counts as the largest
    x[4, V - 1] = float("nan")
    got = _argmax(x)
    assert got.dtype == torch.int64
    assert got.tolist() == x.float().argmax(-1).tolist()
    assert got.tolist()[2:5] == [V // 3, 0, V // 2]


def test_step_rows_are_the_torch_expressions():
    _kernels_run()
    g = torch.Generator().manual_seed(3)
    bs, B = 16, 5
    tables = torch.randperm(200, generator=g)[: B * 8].view(B, 8).to(DEVICE)
    positions = torch.randint(0, 100, (B,), generator=g).to(DEVICE)
    ctx = positions + 1
    kernel = rows_cuda.step_rows if DEVICE == "cuda" else rows_cuda._step_rows
    for j in (1, 2, 3):
        pos, slots, c = kernel(positions, ctx, tables, j, bs)
        want = positions + j
        blocks = tables.gather(1, (want // bs)[:, None]).squeeze(1).long()
        assert pos.tolist() == want.tolist() and c.tolist() == (ctx + j).tolist()
        assert slots.dtype == torch.int64 and slots.tolist() == (blocks * bs + want % bs).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rope_table_holds_the_computed_values(dtype):
    from types import SimpleNamespace

    from specialists.models.llama import Rope

    rope = Rope(SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), 64, DEVICE)
    positions = torch.tensor([0, 5, 77, 511, 300], device=DEVICE)
    cos, sin = rope.cos_sin(positions, dtype)
    rope.tabulate(512, dtype)
    tcos, tsin = rope.cos_sin(positions, dtype)
    assert tcos.stride() == tsin.stride() and tcos.stride(-1) == 1  # one layout, as the fused kernels want
    assert torch.equal(tcos, cos) and torch.equal(tsin, sin)
    other = torch.float16 if dtype != torch.float16 else torch.float32  # another dtype: computed, not the table
    assert rope.cos_sin(positions, other)[0].dtype == other
