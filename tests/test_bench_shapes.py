"""bench.decode --shape: named shapes of real models (parameter counts from their configs, nothing
allocated), random checkpoints our engine loads, and the result line's bandwidth-bound figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.decode import main
from bench.shapes import build_checkpoint, parameter_count, shape_config, weight_bytes

NEW_KEYS = ("params", "weight_bytes", "bandwidth_tb_s", "bound_ms", "ms_per_token", "ratio_to_bound",
            "decode_step_ms", "verify_over_decode", "spec_step_over_decode", "draft_over_target")


@pytest.mark.parametrize("name, low, high", [
    ("llama-1b", 0.97e9, 1.0e9),  # issue 16: 0.99 B (Llama-3.2-1B body, vocab 4096)
    ("llama-3b", 2.80e9, 2.87e9),  # 2.84 B
    ("smollm2-135m", 134.4e6, 134.6e6),  # SmolLM2-135M: 134,515,008
    ("bamba-1b", 0.8e9, 1.3e9),
])
def test_real_shape_parameter_counts(name: str, low: float, high: float) -> None:
    cfg = shape_config(name)
    n = parameter_count(cfg)
    assert low <= n <= high, n
    tied = cfg.tie_word_embeddings  # all four are tied: every parameter once, two bytes each at bf16
    assert tied and weight_bytes(cfg, torch.bfloat16) >= 2 * n
    assert weight_bytes(cfg, torch.bfloat16) < 2 * n + 4 * 1024 * 1024  # only Mamba2's A_log, D, dt_bias are fp32


def test_bamba_1b_layout() -> None:
    cfg = shape_config("bamba-1b")
    kinds = cfg.layers_block_type
    assert len(kinds) == 16 and [i for i, k in enumerate(kinds) if k == "full_attention"] == [3, 7, 11, 15]
    assert (cfg.mamba_d_state, cfg.mamba_d_head, cfg.mamba_expand, cfg.mamba_n_groups, cfg.mamba_d_conv,
            cfg.mamba_chunk_size) == (128, 64, 2, 1, 4, 256)


def test_untied_weight_bytes_count_the_lm_head_not_the_embedding() -> None:
    cfg = shape_config("tiny-llama")
    cfg.tie_word_embeddings = False
    embed = cfg.vocab_size * cfg.hidden_size
    assert parameter_count(cfg) == parameter_count(shape_config("tiny-llama")) + embed
    assert weight_bytes(cfg, torch.float32) == 4 * parameter_count(shape_config("tiny-llama"))


def test_built_checkpoint_loads_with_a_drafter(tmp_path: Path) -> None:
    from specialists.models.loader import load_model
    from specialists.models.mtp import load_drafter

    out = build_checkpoint("tiny-bamba", tmp_path / "b", torch.float32, "cpu", drafter_k=2)
    model = load_model(out)
    assert model.num_mamba_layers == 2 and model.num_attention_layers == 1
    assert load_drafter(out).cfg.hidden_size == 64
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert build_checkpoint("tiny-bamba", out, torch.float32, "cpu") == out  # reused: same build, drafter unused
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def _last_json(capsys) -> dict:
    lines = [line for line in capsys.readouterr().out.strip().splitlines() if line.strip()]
    return json.loads(lines[-1])


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-bamba"])
def test_shape_result_line(tmp_path: Path, capsys, shape: str) -> None:
    """tiny-llama's vocabulary (4608) is larger than the tokenizer's (4096): the model emits ids the
    tokenizer lacks, and nothing breaks."""
    results = tmp_path / "r.jsonl"
    prof = tmp_path / "prof.txt"
    rc = main(["--shape", shape, "--device", "cpu", "--limit", "2", "--max-new-tokens", "8", "--spec-k", "2",
               "--skip-hf", "--shape-dir", str(tmp_path / shape), "--bandwidth-mib", "64",
               "--results", str(results), "--profile", str(prof)])
    assert rc == 0
    result = _last_json(capsys)
    assert result["shape"] == shape
    for key in NEW_KEYS:
        assert isinstance(result[key], (int, float)) and math.isfinite(result[key]) and result[key] > 0, (key, result[key])
    hf = AutoModelForCausalLM.from_config(shape_config(shape))
    assert result["params"] == sum(p.numel() for p in hf.parameters())
    assert result["weight_bytes"] == weight_bytes(shape_config(shape), torch.float32)
    assert result["bound_ms"] == pytest.approx(result["weight_bytes"] / (result["bandwidth_tb_s"] * 1e12) * 1e3, rel=1e-3)
    assert result["ratio_to_bound"] == pytest.approx(result["ms_per_token"] / result["bound_ms"], rel=1e-2)
    assert result["drafts_random"] is True and result["identical_spec"] == 1.0  # greedy speculation stays exact
    assert result["timed_steps"]["verify"] >= 1 and result["timed_steps"]["decode"] >= 1
    assert result["profile"]["steps"] == 16 and result["profile"]["wall_ms_per_step"] > 0
    assert "Name" in prof.read_text()
    assert result["profile_spec"]["steps"] == 16 and "speculative engine" in (tmp_path / "prof.spec.txt").read_text()
    row = json.loads(results.read_text().splitlines()[-1])
    assert row["checkpoint"]["shape"] == shape and row["checkpoint"]["random_weights"] is True


def test_shape_result_line_has_decode_only_latency(tmp_path: Path, capsys) -> None:
    """Without --spec-k: tpot_ms (first token to last, per later token) and ttft_ms of the timed
    requests; at batch 1 the requests run one after another, so their ttft + (n - 1) * tpot add up to
    the timed run (ms_per_token x engine_steps) less the gaps between requests."""
    rc = main(["--shape", "tiny-llama", "--device", "cpu", "--limit", "2", "--max-new-tokens", "8", "--skip-hf",
               "--shape-dir", str(tmp_path / "s"), "--bandwidth-mib", "64", "--results", str(tmp_path / "r.jsonl")])
    assert rc == 0
    result = _last_json(capsys)
    assert result["tpot_ms"] > 0 and result["ttft_ms"] > 0
    assert result["tpot_ratio_to_bound"] == pytest.approx(result["tpot_ms"] / result["bound_ms"], rel=1e-2)
    total = result["ms_per_token"] * result["engine_steps"]  # 2 requests x 8 tokens
    assert 0.6 * total <= 2 * (result["ttft_ms"] + 7 * result["tpot_ms"]) <= 1.05 * total


@pytest.mark.parametrize("shape, overrides", [
    # llama3 rope scaling (Llama-3.2's rope_parameters) at head_dim 64, in two narrow layers
    ("llama-1b", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)),
    # bamba-1b's Mamba2 at mamba-ssm's defaults (d_state 128, head_dim 64, chunk 256), 8 heads wide
    ("bamba-1b", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8)),
])
def test_real_shape_families_match_transformers(tmp_path: Path, capsys, shape: str, overrides: dict) -> None:
    """Our loader takes the real shapes' config features, and greedy tokens equal transformers'."""
    out = build_checkpoint(shape, tmp_path / shape, torch.float32, "cpu", overrides=overrides)
    prompts = Path(__file__).resolve().parents[1] / "bench" / "data" / "shell" / "prompts.jsonl"
    assert main(["--model", str(out), "--prompts", str(prompts), "--limit", "2", "--max-new-tokens", "8"]) == 0
    assert _last_json(capsys)["identical"] == 1.0


def test_llama3_rope_frequencies_match_transformers() -> None:
    """Llama-3.2's rope scaling (llama3) gives our rotary table transformers' frequencies."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from specialists.models.llama import Rope

    cfg = shape_config("llama-1b")
    ours, theirs = Rope(cfg, 64).inv_freq, LlamaRotaryEmbedding(cfg).inv_freq
    assert torch.allclose(ours, theirs.float()) and not torch.allclose(ours, Rope(shape_config("tiny-llama"), 64).inv_freq)
