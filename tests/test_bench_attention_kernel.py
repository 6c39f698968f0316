"""bench.attention_kernel runs the static decode attention at real models' heads (here in Triton's
interpreter, tests/conftest.py sets TRITON_INTERPRET=1) and checks that twice the static width gives
the same bits."""

from __future__ import annotations

import json
import os

import pytest


def test_rows_at_a_real_models_heads(capsys) -> None:
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernel on CPU tensors needs TRITON_INTERPRET=1")
    from bench.attention_kernel import main

    assert main(["--device", "cpu", "--shapes", "smollm2-135m"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(rows) == 3 and all(r["equal_wider"] and r["us"] is None for r in rows)
    assert {(r["heads"], r["kv_heads"], r["head_dim"]) for r in rows} == {(9, 3, 64)}
