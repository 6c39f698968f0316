"""Size presets for the specialists' backbones and drafters.

Every backbone is a standard transformers architecture so that real checkpoints of the same families
load too: Llama (attention only) and Bamba (the Mamba2 hybrid, see README "Why Bamba").
The default presets are sized so that the four shipped specialists, bf16, drafters included, fit in
32 MiB together; the `micro-*` presets are for tests on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import BambaConfig, LlamaConfig, PretrainedConfig


@dataclass(frozen=True)
class Preset:
    family: str  # "llama" | "bamba"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    attn_layer_indices: tuple[int, ...] = ()  # bamba only: which layers are attention
    mamba_n_heads: int = 8
    mamba_d_head: int = 64
    mamba_d_state: int = 64
    mamba_chunk_size: int = 128
    mtp_intermediate_size: int = 256
    max_position_embeddings: int = 2048


PRESETS: dict[str, Preset] = {
    "llama-small": Preset("llama", 256, 448, 4, 4, 2),
    "bamba-small": Preset("bamba", 256, 384, 4, 4, 2, attn_layer_indices=(1, 3)),
    "llama-micro": Preset("llama", 64, 128, 2, 4, 2, mtp_intermediate_size=128, max_position_embeddings=512),
    "bamba-micro": Preset(
        "bamba", 64, 128, 2, 4, 2, attn_layer_indices=(1,), mamba_n_heads=4, mamba_d_head=32,
        mamba_d_state=16, mamba_chunk_size=32, mtp_intermediate_size=128, max_position_embeddings=512,
    ),
}

# Which family each default specialist uses: two hybrids, two attention-only.
DEFAULT_PRESET: dict[str, str] = {
    "cpp": "bamba-small",
    "python": "bamba-small",
    "build": "llama-small",
    "shell": "llama-small",
}


def backbone_config(preset: Preset, vocab_size: int, pad_id: int, eos_id: int) -> PretrainedConfig:
    """The transformers config of a fresh backbone: tied embeddings, no bias, no BOS."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
        rms_norm_eps=1e-5,
    )
    if preset.family == "llama":
        return LlamaConfig(**common, rope_theta=10000.0)
    if preset.family == "bamba":
        return BambaConfig(
            **common,
            attn_layer_indices=list(preset.attn_layer_indices),
            mamba_n_heads=preset.mamba_n_heads,
            mamba_d_head=preset.mamba_d_head,
            mamba_d_state=preset.mamba_d_state,
            mamba_n_groups=1,
            mamba_expand=preset.mamba_n_heads * preset.mamba_d_head // preset.hidden_size,
            mamba_chunk_size=preset.mamba_chunk_size,
            mamba_d_conv=4,
        )
    raise ValueError(f"unknown model family {preset.family!r}")
