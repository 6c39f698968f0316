"""Named model shapes for decode benchmarks at real sizes, built with random weights on the device.

  cfg = shape_config("llama-1b")                      # a transformers LlamaConfig / BambaConfig
  parameter_count(cfg), weight_bytes(cfg, torch.bfloat16)
  build_checkpoint("llama-1b", out_dir, torch.bfloat16, "cuda", drafter_k=3)

A built directory is a checkpoint our loader reads like any other: config.json, model.safetensors
(random weights, transformers' own initialisation, seed 0), the default specialists' tokenizer
(deploy/models/shell: 4096 tokens) and, with `drafter_k`, a random MTP drafter of the matching shape
(one decoder block of the backbone's width, heads and ffn) with a draft vocabulary of the tokenizer's
4096 ids. Drafts of a random drafter are random: only cost ratios are meaningful, never acceptance.

A model vocabulary larger than the tokenizer's (smollm2-135m: 49152) is fine: prompts tokenize to ids
below 4096, the model may emit any id, and ids the tokenizer lacks decode to nothing.

Bytes read per decode step (`weight_bytes`): every parameter once at its stored width (bf16, except
Mamba2's A_log, D, dt_bias kept fp32), except the input embedding when it is not tied to the lm_head
(a step reads one row of it); a tied matrix counts once, as the lm_head it is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, BambaConfig, LlamaConfig, PretrainedConfig

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = ROOT / "deploy" / "models" / "shell"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TOKENIZER_VOCAB = 4096
SHAPE_MARKER = "shape.json"
KEEP_FP32 = ("A_log", "D", "dt_bias")  # Mamba2 parameters our loader keeps in fp32 at low precision

_LLAMA32_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_COMMON = dict(pad_token_id=0, eos_token_id=2, bos_token_id=None, rms_norm_eps=1e-5, tie_word_embeddings=True)

# name -> (family, keyword arguments of its transformers config)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-1b": ("llama", dict(vocab_size=4096, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                               max_position_embeddings=131072, rope_parameters=_LLAMA32_ROPE)),
    "llama-3b": ("llama", dict(vocab_size=4096, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                               num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                               max_position_embeddings=131072, rope_parameters=_LLAMA32_ROPE)),
    "smollm2-135m": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                   max_position_embeddings=8192,
                                   rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    # mamba-ssm's Mamba2 defaults: d_state 128, head_dim 64, expand 2, 1 group, conv 4, chunk 256
    "bamba-1b": ("bamba", dict(vocab_size=4096, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, attn_layer_indices=[3, 7, 11, 15],
                               mamba_n_heads=64, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
                               mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=256, max_position_embeddings=4096)),
    # for tests on CPU: a vocabulary larger than the tokenizer's, and a hybrid
    "tiny-llama": ("llama", dict(vocab_size=4608, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)),
    "tiny-bamba": ("bamba", dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1],
                                 mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1,
                                 mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=32, max_position_embeddings=1024)),
}
SMALL_SHAPES = ("tiny-llama", "tiny-bamba")  # cheap enough for transformers' comparison on a CPU


class UnknownShapeError(KeyError):
    """A shape name not in SHAPES."""


def shape_config(name: str, **overrides: Any) -> PretrainedConfig:
    """The transformers config of shape `name`, with `overrides` (e.g. fewer layers, for tests)."""
    if name not in SHAPES:
        raise UnknownShapeError(f"unknown shape {name!r} (have {sorted(SHAPES)})")
    family, kw = SHAPES[name]
    cls = LlamaConfig if family == "llama" else BambaConfig
    return cls(**{**_COMMON, **kw, **overrides})


def _meta_model(config: PretrainedConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def parameter_count(config: PretrainedConfig) -> int:
    """Every parameter once (a tied lm_head is the embedding), without allocating them."""
    return sum(p.numel() for p in _meta_model(config).parameters())


def weight_bytes(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """Bytes of weights one decode step reads (module docstring: the rule)."""
    model = _meta_model(config)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    embed = model.get_input_embeddings().weight
    width = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, p in model.named_parameters():
        if p is embed and not tied:
            continue
        total += p.numel() * (4 if name.rsplit(".", 1)[-1] in KEEP_FP32 else width)
    return total


def _save_drafter(config: PretrainedConfig, out: Path, dtype: torch.dtype, device: str, k: int) -> None:
    """A random MTP drafter of the backbone's shape and a draft vocabulary of the tokenizer's ids."""
    from safetensors.torch import save_file

    from specialists.models.draftvocab import MTP_VOCAB
    from specialists.models.mtp import MTPConfig, MTPDrafter, save_drafter

    rope = getattr(config, "rope_parameters", None) or {}
    cfg = MTPConfig(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                    num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                    vocab_size=config.vocab_size, num_speculative_tokens=k, rms_norm_eps=config.rms_norm_eps,
                    rope_theta=float(rope.get("rope_theta", 10000.0)))
    with torch.device(device):
        drafter = MTPDrafter(cfg)
    save_drafter(drafter, out, dtype)
    ids = torch.arange(min(config.vocab_size, TOKENIZER_VOCAB), dtype=torch.int64)
    save_file({"token_ids": ids}, str(out / MTP_VOCAB))


def _marker(name: str, dtype: torch.dtype, drafter_k: int | None, seed: int, overrides: dict) -> dict:
    return {"shape": name, "dtype": str(dtype).removeprefix("torch."), "drafter_k": drafter_k, "seed": seed,
            "overrides": overrides, "random_weights": True}


def _reusable(out: Path, marker: dict) -> bool:
    """out holds this build already (a drafter there is fine when none is asked for: it is not loaded)."""
    if not (out / SHAPE_MARKER).is_file():
        return False
    have = json.loads((out / SHAPE_MARKER).read_text())
    if marker["drafter_k"] is None:
        have["drafter_k"] = None
    return have == marker


def build_checkpoint(name: str, out_dir: Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                     drafter_k: int | None = None, seed: int = 0, overrides: dict | None = None) -> Path:
    """Random weights of shape `name` (with config `overrides`), initialised on `device`, saved as a
    checkpoint in out_dir (reused when out_dir already holds the same build). -> out_dir."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    overrides = dict(overrides or {})
    marker = _marker(name, dtype, drafter_k, seed, overrides)
    if _reusable(out, marker):
        return out
    config = shape_config(name, **overrides)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    keep = {n: p for n, p in model.named_parameters()}  # unique: a tied lm_head is saved as the embedding
    tensors = {n: (p.float() if n.rsplit(".", 1)[-1] in KEEP_FP32 else p).detach().contiguous().cpu()
               for n, p in keep.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    for f in TOKENIZER_FILES:
        shutil.copy2(TOKENIZER_DIR / f, out / f)
    for stale in ("mtp.safetensors", "mtp_config.json", "mtp_vocab.safetensors"):
        (out / stale).unlink(missing_ok=True)
    if drafter_k is not None:
        _save_drafter(config, out, dtype, device, drafter_k)
    del model, tensors
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the engine loads its own copy next
    (out / SHAPE_MARKER).write_text(json.dumps(marker) + "\n")
    return out
