"""Weight-only quantization of a target's products on the CPU: the `quantization` engine option.

"int8": every product weight of the model (attention's fused q/k/v and output, the MLP's gate/up and
down, and the lm_head) gets an int8 copy with one scale per output row. Where the native CPU kernels
run (specialists/ops/native.py: AVX-512 VNNI and a C compiler), the whole stack then runs in one
native call per step (models/llama_native.py: int16 activations per row, exact integer sums, each row
attending alone) and the lm_head through the native product; elsewhere specialists/ops/linear.linear
reads the copies with bf16 activations (torch's `_weight_int8pack_mm`), layer by layer in torch.
A decode step streams every weight once, so a quarter of fp32's bytes is what sets its time at batch 1
(SmolLM2-135M's lm_head, [49152 x 576]: 6.9 ms fp32 against 0.64 ms int8 on this CPU). Embedding
lookups, norms and convolutions stay in the checkpoint's dtype. The quantized model's greedy tokens are
not transformers' fp32 ones (a rounding of the weights); speculation's output still equals the same
engine's plain output, at any batch: a row's product does not depend on the rows beside it, and the
engine attends every row alone (ForwardBatch.row_exact), exactly as the decode of its position would:
bf16 activations turn a last-bit difference (padded or multi-query attention) into another token.
Attention-only (Llama / Qwen2) models only: a hybrid's Mamba layers are refused.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from specialists.ops.linear import quantize_int8

PRODUCTS = ("qkv", "o_proj", "gate_up", "down_proj")  # a Llama layer's (hybrids are refused)
AUTO_MIN_PARAMS = 50_000_000  # "auto" quantizes real checkpoints, not the 3.5M-parameter toys


def resolve(model: Any, mode: str) -> str:
    """"auto" -> "int8" on a CPU where the native kernels run, for an fp32 attention-only model of at
    least AUTO_MIN_PARAMS parameters (the imported checkpoints: 2.2-4.8x faster per token, and
    speculation stays exact), else "none"; any other mode as given."""
    if mode != "auto":
        return mode
    from specialists.ops import native

    if model.lm_head.device.type != "cpu" or getattr(model, "family", "") != "llama" or model.dtype != torch.float32:
        return "none"
    return "int8" if _params(model) >= AUTO_MIN_PARAMS and native.available() else "none"


def _params(model: Any) -> int:
    """The embedding's and the products' parameters (a Llama's; hybrids count their embedding only)."""
    return model.embed.numel() + sum(w.numel() for w in product_weights(model)[1:])


def apply(model: Any, cfg: Any) -> tuple[Any, int]:
    """cfg with its quantization resolved (resolve), and how many weights were quantized."""
    mode = resolve(model, cfg.quantization)
    return dataclasses.replace(cfg, quantization=mode), quantize(model, mode)


def product_weights(model: Any) -> list[torch.Tensor]:
    """The weights the model's forward multiplies by through `linear` (the lm_head first)."""
    out = [model.lm_head]
    for layer in model.layers:
        for part in vars(layer).values():
            if not hasattr(part, "__dict__") or isinstance(part, torch.Tensor):  # None, ints, norms
                continue
            out.extend(t for name, t in vars(part).items() if name in PRODUCTS and isinstance(t, torch.Tensor) and t.dim() == 2)
    return out


def quantize(model: Any, mode: str) -> int:
    """Applies `mode` ("none" or "int8") to a CPU model's products -> how many weights were quantized.
    "none" on a CPU with the native kernels, for a model below AUTO_MIN_PARAMS (the toys, whose torch
    steps are overhead): the fp32 stack runs natively too (CANTATA_NATIVE_FP32=0: torch). Larger fp32
    models keep torch's oneDNN products, whose multi-row verify is faster than our fp32 kernel's."""
    if model.lm_head.device.type != "cpu":
        return 0
    if mode == "none":
        if os.environ.get("CANTATA_NATIVE_FP32", "1") != "0" and _params(model) < AUTO_MIN_PARAMS:
            _attach_native(model, fp32=True)
        return 0
    if mode != "int8":
        raise ValueError(f"unknown quantization {mode!r}")
    if getattr(model, "family", "") != "llama":
        raise ValueError(f"quantization 'int8' is for attention-only models, not {model.family!r}: a hybrid's Mamba "
                         "layers differ between a verify and a decode in the last bits, which bf16 activations "
                         "turn into other tokens (speculation would no longer equal plain decoding)")
    from specialists.ops import native

    use_native = native.available() and model.dtype == torch.float32
    n = sum(quantize_int8(w, native=use_native) for w in product_weights(model))
    if use_native:
        _attach_native(model, fp32=False)
    return n


def _attach_native(model: Any, fp32: bool) -> None:
    """The whole stack in one native call per step (models/llama_native.py), where the model allows it."""
    from specialists.models.llama_native import NativeLlama, supports

    if supports(model, fp32) is None:
        model.native = NativeLlama(model, fp32)
