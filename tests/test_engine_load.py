"""bench.engine_load: Poisson arrivals of prompts sharing a head, fed to one engine in real time."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import engine_load


def test_every_request_finishes_and_the_head_is_hit(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "load.jsonl"
    assert engine_load.main(["--shape", "tiny-llama", "--shape-dir", str(tmp_path / "ckpt"), "--requests", "10",
                             "--rate", "40", "--head-tokens", "64", "--max-new-tokens", "6", "--max-num-seqs", "4",
                             "--results", str(out)]) == 0
    row = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip()) == row
    assert row["requests"] == row["finished"] == 10 and row["variant"] == "default" and row["prefill_graph_tokens"] == 0
    assert row["prefix_hit_tokens"] == 10 * 64  # the head's 4 blocks, cached by the warm-up, hit by every request
    assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p99"] and 0 < row["tpot_ms_p50"] <= row["tpot_ms_p99"]
    assert row["output_tok_s"] > 0 and row["commit"]
    # the same arrivals and prompts every run: the same hits
    times, prompts = engine_load._arrivals(argparse.Namespace(seed=0, head_tokens=64, requests=10, rate=40.0), 4608)
    assert times[0] == 0.0 and all(b > a for a, b in zip(times, times[1:])) and all(p[:64] == prompts[0][:64] for p in prompts)


@pytest.mark.parametrize("argv", [["--rate", "0"], ["--requests", "0"], ["--compare-prefill-graphs"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        engine_load.main(["--shape", "tiny-llama", *argv])
    assert exc.value.code == 2
