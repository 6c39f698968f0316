"""Checkpoint loader: config.json + model.safetensors (never pickles) -> our inference model.

    model = load_model("deploy/models/cpp", device="cpu", dtype=torch.float32)
    kv = KVCache(model.kv_cache_config(num_blocks=256, block_size=16))
    ssm = SSMCache(model.ssm_cache_config(num_slots=8))       # hybrids only, else None
    hidden = model.forward(batch, kv, ssm)                     # [T, d]
    logits = model.logits(hidden[batch.logits_indices])       # [n, V]
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Union

import torch

from specialists.models.bamba import BambaModel
from specialists.models.llama import LlamaModel, UnsupportedModelError
from state.kv_cache import KVCacheConfig
from state.ssm_cache import SSMCacheConfig

__all__ = ["InferenceModel", "load_model", "model_from_state_dict", "model_from_hf", "check_supported",
           "UnsupportedModelError"]

logger = logging.getLogger(__name__)

InferenceModel = Union[LlamaModel, BambaModel]


# Qwen2 is Llama with q/k/v biases (o_proj without), which AttentionWeights reads from the state dict.
_FAMILIES = {"llama": LlamaModel, "qwen2": LlamaModel, "bamba": BambaModel}


def check_supported(config: Any) -> type:
    """The inference class for a transformers config, or UnsupportedModelError: an unknown
    model_type, or sliding-window attention (we attend to the whole context in every layer)."""
    cls = _FAMILIES.get(config.model_type)
    if cls is None:
        raise UnsupportedModelError(f"model_type {config.model_type!r} is not supported (have {sorted(_FAMILIES)})")
    if cls is LlamaModel:
        windowed = [t for t in getattr(config, "layer_types", None) or [] if t != "full_attention"]
        if getattr(config, "use_sliding_window", False) or windowed:
            raise UnsupportedModelError(
                f"{config.model_type}: sliding-window attention (use_sliding_window="
                f"{getattr(config, 'use_sliding_window', False)}, sliding_window={getattr(config, 'sliding_window', None)}, "
                f"{len(windowed)} non-full layers) is not supported: every layer here attends to the whole context")
    return cls


def _kv_cache_config(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> KVCacheConfig:
    """KV pool geometry: one layer per attention layer of the model."""
    return KVCacheConfig(
        num_blocks=num_blocks, block_size=block_size, num_layers=self.num_attention_layers,
        num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype, device=str(self.device),
        enable_prefix_cache=enable_prefix_cache,
    )


def _ssm_cache_config(self, num_slots: int) -> SSMCacheConfig | None:
    """SSM slot geometry (None for attention-only models)."""
    if self.num_mamba_layers == 0:
        return None
    p = next(layer.mamba for layer in self.layers if layer.mamba is not None)
    return SSMCacheConfig(
        num_slots=num_slots, num_layers=self.num_mamba_layers, conv_dim=p.conv_dim, d_conv=p.d_conv,
        num_heads=p.num_heads, head_dim=p.head_dim, d_state=p.d_state, conv_dtype=self.dtype,
        device=str(self.device),
    )


for _cls in (LlamaModel, BambaModel):
    _cls.kv_cache_config = _kv_cache_config
    _cls.ssm_cache_config = _ssm_cache_config


def model_from_state_dict(
    config: Any, sd: Mapping[str, torch.Tensor], device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
) -> InferenceModel:
    cls = check_supported(config)
    # The Mamba2 parameters A_log, D, dt_bias stay fp32 at low precision, as the kernels expect.
    keep_fp32 = ("A_log", "D", "dt_bias")
    cast = {
        k: v.detach().to(device=device, dtype=torch.float32 if k.rsplit(".", 1)[-1] in keep_fp32 else dtype)
        for k, v in sd.items()
    }
    return cls(config, cast, device)


def model_from_hf(hf_model: Any, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> InferenceModel:
    """From an in-memory transformers model (tests: tiny random models)."""
    return model_from_state_dict(hf_model.config, hf_model.state_dict(), device, dtype)


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> InferenceModel:
    """Reads <path>/config.json and <path>/model.safetensors; picks the family from model_type."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} not found (only safetensors checkpoints are loaded)")
    sd = load_file(str(weights), device="cpu")
    logger.info("loading %s (%s, %d tensors) to %s %s", path, config.model_type, len(sd), device, dtype)
    model = model_from_state_dict(config, sd, device, dtype)
    model.checkpoint_dir = path  # where quantization="q4" finds the GGUF's blocks (specialists/ggml_blocks.py)
    return model
