"""Llama for inference over a flattened token batch with paged KV (oracle: transformers'
LlamaForCausalLM). Also the shared pieces of the Bamba hybrid: RMSNorm, RoPE (partial rotary
included), the GQA attention block and the SwiGLU MLP.

Plain weight tensors, no autograd: `LlamaModel(config, state_dict)`; `forward(batch, kv)` returns
the final-normed hidden states [T, d] (the drafter's "target hidden"), `logits(hidden)` the tied
(or stored) lm_head's output.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from specialists.models.batch import ForwardBatch
from specialists.ops.attention import HALF, attends_own_kv, paged_attention, use_static_kernel, write_kv
from specialists.models.rope import apply_rope, rope_cos_sin, rope_inv_freq
from specialists.ops.linear import exact_linear, linear

__all__ = ["LlamaModel", "Rope", "AttentionWeights", "MLPWeights", "rms_norm", "attention_block", "mlp_block",
           "fused_step", "fused_attention", "fused_mlp", "folds_norm_gains", "fold_gain_", "fold_norm_gain"]


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture or settings our inference models do not implement."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] -> weight * x / rms(x), computed in fp32 and cast back before the weight
    (as transformers does). In fp32 that is torch's fused rms_norm: one kernel instead of six."""
    dtype = x.dtype
    if (dtype == torch.float32 and weight.dtype == torch.float32) or x.is_cuda:
        # on CUDA one fused kernel for any dtype (fp32 math, the weight applied before the cast back:
        # a last-bit difference from transformers' cast-then-multiply in bf16, for 7 kernels fewer)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class Rope:
    """Rotary embedding as transformers computes it: inv_freq from config.rope_parameters
    (rope_theta, rope_type, partial_rotary_factor), cos/sin = cat(freqs, freqs) * attention_scaling,
    applied with rotate_half to the first rotary_dim channels of each head."""

    def __init__(self, config: Any, head_dim: int, device: str | torch.device = "cpu") -> None:
        params = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = rope_inv_freq(base, int(head_dim * params.get("partial_rotary_factor", 1.0)))
            scaling = 1.0
        elif rope_type in ("dynamic", "longrope"):
            raise UnsupportedModelError(f"rope_type {rope_type!r} (position-dependent inv_freq) is not supported")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        self.inv_freq = inv_freq.float().to(device)  # [rotary_dim / 2]
        self.scaling = float(scaling)
        self.rotary_dim = 2 * self.inv_freq.shape[0]
        self._table: torch.Tensor | None = None  # [n, 2, rotary_dim] cos, sin by position (tabulate)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rotary_dim] (with a table in dtype: two views of one gather)."""
        table = self._table
        if table is not None and table.dtype == dtype and positions.device == table.device:
            cs = table[positions]  # [T, 2, R]
            return cs[:, 0], cs[:, 1]
        return rope_cos_sin(positions, self.inv_freq, dtype, self.scaling)

    def tabulate(self, n: int, dtype: torch.dtype) -> None:
        """cos / sin of positions 0..n-1 in dtype, computed once by the same elementwise ops, so the same
        values: a CUDA graph's step gathers its rows (one kernel) instead of computing them (~7 a token).
        Positions must stay below n (the runner's block tables' width)."""
        self._table = torch.stack(rope_cos_sin(torch.arange(n, device=self.inv_freq.device), self.inv_freq, dtype,
                                               self.scaling), dim=1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D], cos/sin [T, R] -> x with its first R channels rotated."""
        return apply_rope(x, cos[:, None, :], sin[:, None, :])


@dataclass
class AttentionWeights:
    q_proj: torch.Tensor  # [H_q * D, d]
    k_proj: torch.Tensor  # [H_kv * D, d]
    v_proj: torch.Tensor  # [H_kv * D, d]
    o_proj: torch.Tensor  # [d, H_q * D]
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    folded: bool = False  # the input norm's gain is in qkv's columns (fold_norm_gain)

    def __post_init__(self) -> None:
        # q, k and v in one matmul (one read of x, one kernel launch)
        self.qkv = torch.cat([self.q_proj, self.k_proj, self.v_proj]).contiguous()
        biases = (self.q_bias, self.k_bias, self.v_bias)
        self.qkv_bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else self.q_proj.new_zeros(w.shape[0]) for b, w in zip(biases, (self.q_proj, self.k_proj, self.v_proj))])
        self.split = [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim]
        self.q_proj, self.k_proj, self.v_proj = self.qkv.split(self.split)  # views: the weights are held once

    @classmethod
    def from_state_dict(cls, sd: Mapping[str, torch.Tensor], prefix: str, num_heads: int, num_kv_heads: int,
                        head_dim: int) -> "AttentionWeights":
        g = sd.get
        return cls(
            sd[prefix + "q_proj.weight"], sd[prefix + "k_proj.weight"], sd[prefix + "v_proj.weight"],
            sd[prefix + "o_proj.weight"], g(prefix + "q_proj.bias"), g(prefix + "k_proj.bias"),
            g(prefix + "v_proj.bias"), g(prefix + "o_proj.bias"), num_heads, num_kv_heads, head_dim,
        )


@dataclass
class MLPWeights:
    gate_proj: torch.Tensor  # [I, d]
    up_proj: torch.Tensor  # [I, d]
    down_proj: torch.Tensor  # [d, I]
    gate_bias: torch.Tensor | None
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    folded: bool = False  # the post-attention norm's gain is in gate_up's columns (fold_norm_gain)

    def __post_init__(self) -> None:
        self.gate_up = torch.cat([self.gate_proj, self.up_proj]).contiguous()  # one matmul for both
        self.gate_up_bias = None if self.gate_bias is None and self.up_bias is None else torch.cat(
            [b if b is not None else self.gate_proj.new_zeros(self.gate_proj.shape[0]) for b in (self.gate_bias, self.up_bias)])
        self.gate_proj, self.up_proj = self.gate_up.chunk(2)  # views: the weights are held once

    @classmethod
    def from_state_dict(cls, sd: Mapping[str, torch.Tensor], prefix: str) -> "MLPWeights":
        g = sd.get
        return cls(sd[prefix + "gate_proj.weight"], sd[prefix + "up_proj.weight"], sd[prefix + "down_proj.weight"],
                   g(prefix + "gate_proj.bias"), g(prefix + "up_proj.bias"), g(prefix + "down_proj.bias"))


FOLD_MIN_HIDDEN = 2048  # folding gained at d 2048 and 3072 and lost 6.6% at smollm2's 576 (H200, session 32)


def folds_norm_gains(x: torch.Tensor) -> bool:
    """Whether a model whose embedding is x [V, d] folds its layers' RMSNorm gains into the products after
    them: CUDA, half precision, the fused decode path on, and d >= FOLD_MIN_HIDDEN (CANTATA_FOLD_NORM=1:
    at any d, 0: never). The fused products then stream x as it is (decode_fused.mma's kind 3, the MLP's
    SwiGLU at gate/up's end): TPOT llama-1b 0.911 ms against 0.983, llama-3b 2.289 against 2.463, bamba-1b
    1.038 against 1.094; smollm2-135m 0.761 against 0.714 (H200, bench/RESULTS.md, session 32)."""
    env = os.environ.get("CANTATA_FOLD_NORM")
    return (x.is_cuda and x.dtype in HALF and os.environ.get("CANTATA_FUSED_DECODE", "1") != "0" and env != "0"
            and (env == "1" or x.shape[-1] >= FOLD_MIN_HIDDEN))


def fold_gain_(w: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """An RMSNorm's gain folded into the product after it: w's columns times the gain, in place (fp32,
    rounded once); -> the gain the norm keeps (ones): every path then computes rms_norm(x) @ (W * gain)^T,
    the prefills' torch ops and the fused decodes alike."""
    w.copy_((w.float() * gain.float()).to(w.dtype))
    return torch.ones_like(gain)


def fold_norm_gain(w: AttentionWeights | MLPWeights, gain: torch.Tensor) -> torch.Tensor:
    """fold_gain_ into q/k/v or gate/up, marking the weights folded (the fused path's kinds 3 and 4)."""
    ones = fold_gain_(w.qkv if isinstance(w, AttentionWeights) else w.gate_up, gain)
    w.folded = True
    return ones


def attend(w: AttentionWeights, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor, batch: ForwardBatch,
           let_next: bool = False) -> torch.Tensor:
    """The fused q/k/v product [T, (H_q + 2 H_kv) D] -> attention output [T, H_q D]: RoPE on q and k,
    k and v written to the pool at the batch's slots, q over its sequence's keys (a q [T, H_q, D]
    given as qkv: the product did those already, decode_fused.RopeKV). let_next: the o product after
    it launches early (decode_fused.launches_early); the static kernel lets it."""
    T = qkv.shape[0]
    fresh = None  # a one-sequence prefill's own k and v: attended without gathering them back from the pool
    if qkv.dim() == 3:  # rotated q: the product wrote k and v
        q = qkv
    elif qkv.is_cuda and qkv.dtype in HALF:  # one Triton kernel: RoPE on q and k, k and v into the pool
        from specialists.ops.rope_kv import rope_write_kv  # Triton: a GPU install has it

        if attends_own_kv(batch):
            fresh = (qkv.new_empty(T, w.num_kv_heads, w.head_dim),
                     qkv[:, w.split[0] + w.split[1]:].view(T, w.num_kv_heads, w.head_dim))
        q = rope_write_kv(qkv, cos, sin, k_cache_layer, v_cache_layer, batch.slot_mapping, w.num_heads,
                          w.num_kv_heads, w.head_dim, k_out=None if fresh is None else fresh[0])
    else:
        qk, v = qkv.split([w.split[0] + w.split[1], w.split[2]], dim=-1)
        qk = Rope.apply(qk.view(T, w.num_heads + w.num_kv_heads, w.head_dim), cos, sin)  # q and k heads rotated at once
        q, k = qk.split([w.num_heads, w.num_kv_heads], dim=1)
        fresh = (k, v.view(T, w.num_kv_heads, w.head_dim))
        write_kv(*fresh, k_cache_layer, v_cache_layer, batch.slot_mapping)
    if let_next and use_static_kernel(q, batch):
        from specialists.ops.attention_cuda import paged_attention_static  # Triton: a GPU install has it

        o = paged_attention_static(q, k_cache_layer, v_cache_layer, batch, w.head_dim ** -0.5, let_next=True)
    else:
        o = paged_attention(q, k_cache_layer, v_cache_layer, batch, scale=w.head_dim ** -0.5, fresh=fresh)
    return o.reshape(T, w.num_heads * w.head_dim)


def attention_block(
    w: AttentionWeights,
    x: torch.Tensor,  # [T, d], normed
    cos: torch.Tensor,  # [T, R]
    sin: torch.Tensor,  # [T, R]
    k_cache_layer: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache_layer: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    batch: ForwardBatch,
) -> torch.Tensor:  # [T, d]
    o = attend(w, linear(x, w.qkv, w.qkv_bias), cos, sin, k_cache_layer, v_cache_layer, batch)
    return linear(o, w.o_proj, w.o_bias)


def mlp_block(w: MLPWeights, x: torch.Tensor) -> torch.Tensor:  # x [T, d] -> [T, d]
    gate, up = linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w.down_proj, w.down_bias)


def fused_step(h: torch.Tensor) -> bool:
    """Whether a step runs the fused path: CUDA, half precision, at most decode_fused.MAX_ROWS rows
    (decodes, verifies). Its `mma` products give a row the same bits at any row count, so a verify
    computes its decodes' products (cuBLAS, which the path took above 32 rows before ce59499, picks its
    kernel by the row count: bf16 toys at batch 8, K=5 gave 2-3 of 32 prompts other tokens)."""
    if not (h.is_cuda and h.dtype in HALF):
        return False
    from specialists.ops import decode_fused  # Triton: a GPU install has it

    return decode_fused.enabled(h)


def fused_attention(w: AttentionWeights, gain: torch.Tensor, eps: float, h: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor, batch: ForwardBatch) -> None:
    """h += attention_block(w, rms_norm(h) * gain, ...), in place, on the fused path (fused_step)."""
    from specialists.ops import decode_fused

    rope = None
    if decode_fused.rope_fuses(w.qkv, w.head_dim, cos, sin, w.folded):  # RoPE and the KV write in the product's end
        rope = decode_fused.RopeKV(cos, sin, batch.slot_mapping, k_cache_layer, v_cache_layer, w.num_heads, w.num_kv_heads)
    qkv = decode_fused.mma(h, w.qkv, w.qkv_bias, gain=None if w.folded else gain, eps=eps, rope=rope, folded=w.folded)
    o = attend(w, qkv, cos, sin, k_cache_layer, v_cache_layer, batch, decode_fused.launches_early(w.o_proj))
    decode_fused.mma(o, w.o_proj, w.o_bias, residual=h)


def fused_mlp(w: MLPWeights, gain: torch.Tensor, eps: float, h: torch.Tensor) -> None:
    """h += mlp_block(w, rms_norm(h) * gain), in place, on the fused path (fused_step)."""
    from specialists.ops import decode_fused

    if w.folded:  # the gain is in gate_up: the SwiGLU at its end, a plain down
        a = decode_fused.mma(h, w.gate_up, w.gate_up_bias, eps=eps, folded=True, glu=True)
        decode_fused.mma(a, w.down_proj, w.down_bias, residual=h)
        return
    gate_up = decode_fused.mma(h, w.gate_up, w.gate_up_bias, gain=gain, eps=eps)
    decode_fused.mma(gate_up, w.down_proj, w.down_bias, swiglu=True, residual=h)


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def lm_head_of(sd: Mapping[str, torch.Tensor], config: Any) -> torch.Tensor:
    """The stored lm_head, or the embedding when tied (or when the head is not stored)."""
    if not getattr(config, "tie_word_embeddings", True) and "lm_head.weight" in sd:
        return sd["lm_head.weight"]
    return sd["model.embed_tokens.weight"]


@dataclass
class _LlamaLayer:
    input_norm: torch.Tensor  # [d]
    post_norm: torch.Tensor  # [d]
    attn: AttentionWeights
    mlp: MLPWeights


class DecoderBase:
    """What every family shares: config, embedding, tied or separate lm_head, final norm."""

    def __init__(self, config: Any, sd: Mapping[str, torch.Tensor], device: str | torch.device, final_norm_key: str) -> None:
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"only silu is supported, got {config.hidden_act!r}")
        self.config = config
        self.device = torch.device(device)
        self.head_dim = head_dim_of(config)
        self.num_kv_heads = config.num_key_value_heads
        self.eps = config.rms_norm_eps
        self.embed = sd["model.embed_tokens.weight"]  # [V, d]
        self.lm_head = lm_head_of(sd, config)  # [V, d]
        self.norm = sd[final_norm_key]  # [d]

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # hidden [n, d] -> [n, V]
        """A verify's logits are its decodes' bit for bit (ops/linear.exact_linear)."""
        return exact_linear(hidden, self.lm_head)


class LlamaModel(DecoderBase):
    family = "llama"

    def __init__(self, config: Any, sd: Mapping[str, torch.Tensor], device: str | torch.device = "cpu") -> None:
        super().__init__(config, sd, device, "model.norm.weight")
        self.layers = [
            _LlamaLayer(
                sd[f"model.layers.{i}.input_layernorm.weight"],
                sd[f"model.layers.{i}.post_attention_layernorm.weight"],
                AttentionWeights.from_state_dict(sd, f"model.layers.{i}.self_attn.", config.num_attention_heads,
                                                 config.num_key_value_heads, self.head_dim),
                MLPWeights.from_state_dict(sd, f"model.layers.{i}.mlp."),
            )
            for i in range(config.num_hidden_layers)
        ]
        self.rope = Rope(config, self.head_dim, self.device)
        self.dtype = self.embed.dtype
        if folds_norm_gains(self.embed):
            for layer in self.layers:
                layer.input_norm = fold_norm_gain(layer.attn, layer.input_norm)
                layer.post_norm = fold_norm_gain(layer.mlp, layer.post_norm)
        self.native = None  # llama_native.NativeLlama: set by specialists/quantize.py where the CPU kernels run

    @property
    def num_attention_layers(self) -> int:
        return len(self.layers)

    @property
    def num_mamba_layers(self) -> int:
        return 0

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, kv, ssm=None) -> torch.Tensor:  # -> hidden [T, d], final-normed
        h = self.embed[batch.input_ids]
        cos, sin = self.rope.cos_sin(batch.positions, h.dtype)
        if self.native is not None and not batch.static and h.device.type == "cpu":
            return self.native(batch, kv, h, cos, sin)
        if fused_step(h):
            for i, layer in enumerate(self.layers):
                fused_attention(layer.attn, layer.input_norm, self.eps, h, cos, sin, kv.k[i], kv.v[i], batch)
                fused_mlp(layer.mlp, layer.post_norm, self.eps, h)
            return rms_norm(h, self.norm, self.eps)
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, self.eps)
            h = h + attention_block(layer.attn, x, cos, sin, kv.k[i], kv.v[i], batch)
            h = h + mlp_block(layer.mlp, rms_norm(h, layer.post_norm, self.eps))
        return rms_norm(h, self.norm, self.eps)

    __call__ = forward
