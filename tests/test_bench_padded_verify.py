"""bench.padded_verify_ab on this CPU (static steps run eagerly): with a request inside a tool call among
speculating ones, the padded side runs every decode step static and the unpadded side does not; the
padded side's tokens equal the unpadded side's and plain decoding's; the row names what it measured."""

from __future__ import annotations

import json
from pathlib import Path

from bench import padded_verify_ab

SHELL = str(Path(__file__).resolve().parents[1] / "deploy" / "models" / "shell")


def test_padded_rows_keep_the_steps_static_and_the_tokens(tmp_path) -> None:
    out = tmp_path / "rows.jsonl"
    line = padded_verify_ab.main(["--model", SHELL, "--batch-size", "4", "--spec-k", "3", "--tool-tag",
                                  "--max-new-tokens", "40", "--rounds", "2", "--device", "cpu", "--results", str(out)])
    assert json.loads(out.read_text()) == line
    pad, no_pad = line["rounds"]["pad"], line["rounds"]["no_pad"]
    assert all(r["static_steps"] == r["steps"] - 1 for r in pad)  # all but the prompts' step
    assert all(a["static_steps"] > b["static_steps"] for a, b in zip(pad, no_pad))
    assert line["identical_pad_no_pad"] == [True, True] and line["identical_pad_plain"] == [True, True]
    assert line["device"] == "cpu" and line["dtype"] == "float32" and line["commit"]
