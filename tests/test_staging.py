"""specialists/staging.py's stage_rows: its path for steps of uniform rows (decodes, verifies of one
length: most steps) writes exactly what the general path writes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specialists.runner import BatchRow
from specialists.staging import Layout, StaticInputs, stage_rows


@pytest.mark.parametrize("q", [1, 4])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_the_uniform_path_stages_what_the_general_path_stages(q: int, B: int) -> None:
    rng = np.random.default_rng(7 * q + B)
    bs = 16
    starts = [int(s) for s in rng.integers(0, 200, B)]
    tables = [[int(b) for b in rng.permutation(512)[: (s + q + bs - 1) // bs + int(rng.integers(0, 2))]] for s in starts]
    rows = [BatchRow(seq_id=i, tokens=[int(rng.integers(1, 1000))], prefill=False, ssm_slot=i, k=q - 1) for i in range(B)]
    staged = []
    for uniform in (True, False):
        inp = StaticInputs(torch.device("cpu"), max_tokens=64, max_seqs=16, max_blocks=32)
        inp.np[:] = -7  # what stage_rows leaves alone must stay alike too
        lay = Layout(B=B, T=B * q, Bp=B, Tp=B * q, q_pad=q, width=32, static=False, uniform=uniform)
        n = stage_rows(inp, rows, starts, tables, lay, bs)
        staged.append((n, inp.np.copy()))
    assert staged[0][0] == staged[1][0] == B * q
    assert np.array_equal(staged[0][1], staged[1][1])
