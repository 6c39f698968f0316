"""A Llama's forward as one native call per step (specialists/ops/native.py), on a CPU with AVX-512
VNNI: over the int8 copies of `quantization="int8"`, the GGUF's own blocks of `quantization="q4"`
(specialists/ggml_blocks.py), or (fp32=True) over the checkpoint's fp32 weights (`quantization="none"`:
the same products as a fixed-order fp32 sum per element).

`NativeLlama(model)` takes the int8 copies `quantize_int8` made of the model's products (one fp32
scale per output row) and a table of every layer's pointers; `model.forward` hands it a step's batch
(any mix of prefills, decodes and verifies; not a static CUDA batch). With int8 weights activations
are quantized per row to int16 (finer than the torch path's bf16); each row attends alone over its
own sequence's keys [0, position]: a row's result is the same bit for bit in any step, so speculation
equals plain decoding. Only the embedding lookup and RoPE's cos/sin stay in torch.
"""

from __future__ import annotations

from typing import Any

import torch

from specialists.models.batch import ForwardBatch
from specialists.ops import native
from specialists.ops.linear import BlockLinear, int8_of

__all__ = ["NativeLlama", "supports"]

def supports(model: Any, fp32: bool = False) -> str | None:
    """None if `model` can take the native forward (over its int8 copies, or its fp32 weights), else why not."""
    if not native.available():
        return f"native kernels unavailable: {native.why_unavailable()}"
    if getattr(model, "family", "") != "llama" or model.dtype != torch.float32 or model.lm_head.device.type != "cpu":
        return "the native forward is for fp32 Llama / Qwen2 checkpoints on the CPU"
    if model.rope.rotary_dim % 2 or model.rope.rotary_dim > model.head_dim:
        return "unsupported rotary width"
    widest = max(max(l.attn.qkv.shape[1], l.attn.o_proj.shape[1], l.mlp.down_proj.shape[1]) for l in model.layers)
    if widest > native.MAX_K:
        return f"a product {widest} wide exceeds the kernel's {native.MAX_K}"
    if not fp32:
        kinds = {type(int8_of(w)) for l in model.layers for w in (l.attn.qkv, l.attn.o_proj, l.mlp.gate_up, l.mlp.down_proj)}
        if type(None) in kinds:
            return "not every product is quantized"
        if len(kinds) > 1:
            return "the products mix int8 copies and GGML blocks"
    return None


def _mode(model: Any, fp32: bool) -> int:
    """The C side's MODE_*: 0 int8 copies, 1 fp32 weights, 2 GGML blocks."""
    return 1 if fp32 else 2 if isinstance(int8_of(model.layers[0].attn.qkv), BlockLinear) else 0


class NativeLlama:
    def __init__(self, model: Any, fp32: bool = False) -> None:
        why = supports(model, fp32)
        if why:
            raise ValueError(why)
        self.fp32 = fp32
        mode = _mode(model, fp32)
        self._f = native.Addresses()  # keeps every tensor a pointer in the table refers to
        rows = []  # per layer, in the order of the C side's P_* enum: norms, then (weight, scale, bias) x 4, KV
        for layer in model.layers:
            a, m = layer.attn, layer.mlp
            row = [self._f(layer.input_norm), self._f(layer.post_norm)]
            for w, b in ((a.qkv, a.qkv_bias), (a.o_proj, a.o_bias), (m.gate_up, m.gate_up_bias), (m.down_proj, m.down_bias)):
                q = None if fp32 else int8_of(w)
                if fp32:  # the weights as they are (no scale)
                    row += [self._f(w), 0, self._f(b)]
                elif mode == 2:  # packed blocks, and their type where int8 has its scales
                    row += [self._f(q.packed), q.kind, self._f(b)]
                else:
                    row += [self._f(q.w), self._f(q.scale32), self._f(b)]
            rows.append(row + [0, 0])  # the KV pool's layers: filled per pool
        self.table = torch.tensor(rows, dtype=torch.int64)
        self.final_norm = model.norm.float().contiguous()
        cfg = model.config
        a = model.layers[0].attn
        self.dims = [0, cfg.hidden_size, len(model.layers), a.num_heads, a.num_kv_heads, a.head_dim,
                     model.rope.rotary_dim, model.layers[0].mlp.down_proj.shape[1], 0, 0, 1, mode]
        self.floats = torch.tensor([model.eps, a.head_dim ** -0.5], dtype=torch.float32)
        self._pool: tuple[int, ...] = ()

    def _bind(self, kv: Any) -> None:
        """Points the table at this KV pool's layers (kv.k / kv.v: [L, blocks, block_size, H_kv, D]), again
        only when the pool moved: one check per step, no per-layer views."""
        key = (kv.k.data_ptr(), kv.v.data_ptr())
        if key == self._pool:
            return
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in (kv.k, kv.v)):
            raise ValueError("the native forward needs a contiguous fp32 KV pool")
        step = kv.k.stride(0) * kv.k.element_size()  # bytes per layer
        layers = torch.arange(len(self.table), dtype=torch.int64) * step
        self.table[:, -2] = key[0] + layers
        self.table[:, -1] = key[1] + layers
        self._pool = key

    def __call__(self, batch: ForwardBatch, kv: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h [T, d] fp32 (the embeddings, overwritten: the residual stream) -> final-normed hidden [T, d]."""
        self._bind(kv)
        T = h.shape[0]
        h = h.contiguous()
        out = torch.empty_like(h)
        if T == 0:
            return out
        tables = native.int64(batch.block_tables)
        self.dims[0], self.dims[8], self.dims[9], self.dims[10] = T, kv.k.shape[2], tables.shape[1], torch.get_num_threads()
        ints = torch.tensor(self.dims, dtype=torch.int32)
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        pos, slots, seq = (native.int64(t) for t in (batch.positions, batch.slot_mapping, batch.token_seq))
        rc = native.library().cantata_llama_forward(
            ints.data_ptr(), self.floats.data_ptr(), h.data_ptr(), out.data_ptr(), self.final_norm.data_ptr(),
            pos.data_ptr(), slots.data_ptr(), seq.data_ptr(), tables.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            self.table.data_ptr())
        if rc:
            raise MemoryError("the native forward could not allocate its scratch")
        return out
