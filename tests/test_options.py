"""specialists/options.py: the engine's options resolved once (per-device defaults, environment
variables read there), and passed by keyword through Engine.from_pretrained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from policies.policy import SpeculationPolicy
from specialists.engine import Engine
from specialists.options import EngineOptions, OptionsError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("CANTATA_STATIC_BATCHES", raising=False)
    monkeypatch.delenv("CANTATA_CUDA_GRAPHS", raising=False)
    return monkeypatch


def test_cpu_defaults(clean_env: pytest.MonkeyPatch) -> None:
    cfg = EngineOptions(max_num_seqs=4, max_model_len=4096).resolve(model_max_len=1024)
    assert cfg.device == torch.device("cpu") and cfg.max_model_len == 1024  # capped by the model
    assert not (cfg.pad_batches or cfg.static_batches or cfg.cuda_graphs or cfg.fused_drafter)
    assert cfg.num_blocks == 4 * (1024 // 16) and cfg.draft_min_confidence == 0.0


def test_cuda_defaults_and_the_graphs_switch(clean_env: pytest.MonkeyPatch) -> None:
    cfg = EngineOptions(device="cuda").resolve()
    assert cfg.cuda_graphs and cfg.static_batches and cfg.pad_batches and cfg.max_model_len == 2048
    clean_env.setenv("CANTATA_CUDA_GRAPHS", "0")
    off = EngineOptions(device="cuda").resolve()
    assert not off.cuda_graphs and not off.static_batches and off.pad_batches
    assert not EngineOptions(device="cuda", pad_batches=False).resolve().static_batches


def test_static_batches_from_the_environment(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("CANTATA_STATIC_BATCHES", "1")
    cfg = EngineOptions().resolve()
    assert cfg.static_batches and cfg.pad_batches and not cfg.cuda_graphs
    assert not EngineOptions(static_batches=False).resolve().static_batches  # the argument wins
    assert not EngineOptions(pad_batches=False).resolve().static_batches  # static batches are padded ones


def test_keywords_replace_fields_and_unknown_names_raise() -> None:
    base = EngineOptions(max_num_seqs=4, block_size=32)
    opts = EngineOptions.from_keywords(base, max_num_seqs=2)
    assert (opts.max_num_seqs, opts.block_size) == (2, 32)
    with pytest.raises(OptionsError, match="max_seqs"):
        EngineOptions.from_keywords(base, max_seqs=2)


def test_from_pretrained_takes_options_and_keywords(clean_env: pytest.MonkeyPatch) -> None:
    path = ROOT / "deploy" / "models" / "shell"
    off = SpeculationPolicy(mode="off")
    eng = Engine.from_pretrained(path, EngineOptions(max_num_seqs=2, num_blocks=40), policy=off, static_batches=True)
    assert (eng.cfg.max_num_seqs, eng.cfg.num_blocks, eng.kv.cfg.num_blocks) == (2, 40, 40)
    assert eng.runner.static and eng.drafter is None
    with pytest.raises(OptionsError):
        Engine.from_pretrained(path, policy=off, max_seqs=2)
