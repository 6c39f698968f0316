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


@pytest.mark.parametrize("q", [1, 4, 6])
def test_advance_rows_kernel_is_the_torch_path(q, monkeypatch):
    """A verify launched ahead, moved past what the verify before it kept: the kernel writes what
    staging.advance_rows' torch ops write, real rows only (the padding row stays as built)."""
    _kernels_run()
    from types import SimpleNamespace

    from specialists.staging import advance_rows

    g = torch.Generator().manual_seed(q)
    bs, B, Bp, width = 16, 3, 4, 8
    tables = torch.randperm(300, generator=g)[: Bp * width].view(Bp, width)
    start = torch.randint(0, 60, (Bp,), generator=g)
    positions = (start[:, None] + torch.arange(q)).reshape(-1)
    slots = torch.randint(0, 999, (Bp * q,), generator=g)
    ids = torch.randint(0, 4096, (Bp * q,), generator=g)
    ctx = start + q
    packed = torch.randint(5, 4096, (Bp, 1 + 2 * q), generator=g)
    packed[:, 0] = torch.tensor([0, q - 1, q // 2, 1])[:Bp]  # drafts kept a row
    drafts = torch.randint(5, 4096, (Bp, max(1, q - 1) + 2), generator=g)[:, 1:]  # a column offset view, as a chain's slice

    def fields():
        return [t.clone().to(DEVICE) for t in (ids, positions, slots, ctx, tables, packed)] + [drafts.to(DEVICE)]

    want = fields()
    batch = SimpleNamespace(input_ids=want[0], positions=want[1], slot_mapping=want[2], context_lens=want[3],
                            block_tables=want[4], max_query_len=q)
    monkeypatch.setenv("CANTATA_FUSED_ADVANCE", "0")  # on a GPU too: the torch ops
    advance_rows(batch, want[5], want[6], B, bs)
    got = fields()
    rows_cuda.advance_rows(*got, B, q, bs)
    for name, a, b in zip(("ids", "positions", "slots", "contexts"), got, want):
        assert a.tolist() == b.tolist(), name
    step = packed[:B, 0] + 1
    assert got[1].view(Bp, q)[:B, 0].tolist() == (start[:B] + step).tolist()  # it moved at all
    assert got[0].view(Bp, q)[B:].tolist() == ids.view(Bp, q)[B:].tolist()  # the padding row: untouched


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
