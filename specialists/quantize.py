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
"q4": the checkpoint's products as the GGUF it was imported from has them (Q4_1 layers, a Q8_0 head:
specialists/ggml_blocks.py), so our tokens come from the model llama.cpp runs, not from a second
rounding of it; a head of another type gets an int8 copy. The embedding lookup takes the file's
values too (exact in fp32; a bf16 checkpoint had rounded them). Native kernels only (activations rounded
to int8 per block of 32, as llama.cpp does, exact block sums): 0.69 bytes a weight against int8's 1.
Attention-only (Llama / Qwen2) models only: a hybrid's Mamba layers are refused.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from specialists import ggml_blocks
from specialists.ops.linear import quantize_blocks, quantize_int8

PRODUCTS = ("qkv", "o_proj", "gate_up", "down_proj")  # a Llama layer's (hybrids are refused)
AUTO_MIN_PARAMS = 50_000_000  # "auto" quantizes real checkpoints, not the 3.5M-parameter toys
Q4_PARTS = (("attn", "qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),  # fused as the model fuses
            ("attn", "o_proj", ("self_attn.o_proj",)), ("mlp", "gate_up", ("mlp.gate_proj", "mlp.up_proj")),
            ("mlp", "down_proj", ("mlp.down_proj",)))


def resolve(model: Any, mode: str) -> str:
    """"auto" -> on a CPU where the native kernels run, for an fp32 attention-only model of at least
    AUTO_MIN_PARAMS parameters (the imported checkpoints): "q4" where the checkpoint has its GGUF's
    blocks, else "int8" (2.2-4.8x faster per token than fp32, and speculation stays exact); else
    "none". Any other mode as given."""
    if mode != "auto":
        return mode
    from specialists.ops import native

    if model.lm_head.device.type != "cpu" or getattr(model, "family", "") != "llama" or model.dtype != torch.float32:
        return "none"
    if _params(model) < AUTO_MIN_PARAMS or not native.available():
        return "none"
    return "q4" if _blocks_file(model) is not None else "int8"


def _blocks_file(model: Any) -> Path | None:
    where = getattr(model, "checkpoint_dir", None)
    path = Path(where) / ggml_blocks.FILE if where is not None else None
    return path if path is not None and path.is_file() else None


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
    if mode not in ("int8", "q4"):
        raise ValueError(f"unknown quantization {mode!r}")
    if getattr(model, "family", "") != "llama":
        raise ValueError(f"quantization {mode!r} is for attention-only models, not {model.family!r}: a hybrid's Mamba "
                         "layers differ between a verify and a decode in the last bits, which bf16 activations "
                         "turn into other tokens (speculation would no longer equal plain decoding)")
    from specialists.ops import native

    if mode == "q4":
        return _quantize_q4(model)
    use_native = native.available() and model.dtype == torch.float32
    n = sum(quantize_int8(w, native=use_native) for w in product_weights(model))
    if use_native:
        _attach_native(model, fp32=False)
    return n


def _quantize_q4(model: Any) -> int:
    """Every layer product from the checkpoint's GGML blocks (fused as the model fuses them), the head
    too where the file has it; then the native forward."""
    from specialists.ops import native

    path = _blocks_file(model)
    if path is None:
        raise ValueError(f"quantization 'q4' needs the GGML blocks of a GGUF import ({ggml_blocks.FILE} in the "
                         f"checkpoint, written by `python -m specialists.train import-gguf`); "
                         f"{getattr(model, 'checkpoint_dir', 'this model')} has none: use 'int8'")
    if not native.available() or model.dtype != torch.float32:
        raise ValueError("quantization 'q4' runs on the native CPU kernels over an fp32 model: "
                         f"{native.why_unavailable() or 'the model is ' + str(model.dtype)}; use 'int8'")
    blocks = ggml_blocks.read(path.parent)
    n = 0
    for i, layer in enumerate(model.layers):
        for owner, attr, names in Q4_PARTS:
            n += _register(getattr(getattr(layer, owner), attr), [blocks[f"model.layers.{i}.{name}.weight"] for name in names])
    tied = getattr(model.config, "tie_word_embeddings", True)
    emb = blocks.get("model.embed_tokens.weight")
    if emb is not None:  # the lookup reads the file's values too (a bf16 checkpoint rounded them)
        values = torch.from_numpy(ggml_blocks.dequantize(emb[0], emb[1].numpy()))
        if values.shape == model.embed.shape:
            model.embed = values
    head = blocks.get("lm_head.weight") or (emb if tied else None)
    n += _register(model.lm_head, [head]) if head is not None else quantize_int8(model.lm_head, native=True)
    _attach_native(model, fp32=False)
    return n


def _register(w: torch.Tensor, parts: list) -> int:
    kind, raw = ggml_blocks.fuse(parts)
    if raw.shape[0] != w.shape[0] or raw.shape[1] // ggml_blocks.TYPES[kind][1] * ggml_blocks.QB != w.shape[1]:
        raise ValueError(f"GGML blocks of {raw.shape[0]} rows x {raw.shape[1]} bytes ({kind}) do not fit a "
                         f"[{w.shape[0]} x {w.shape[1]}] weight")
    quantize_blocks(w, ggml_blocks.kernel_type(kind), ggml_blocks.pack(kind, raw))
    return 1


def _attach_native(model: Any, fp32: bool) -> None:
    """The whole stack in one native call per step (models/llama_native.py), where the model allows it."""
    from specialists.models.llama_native import NativeLlama, supports

    if supports(model, fp32) is None:
        model.native = NativeLlama(model, fp32)
