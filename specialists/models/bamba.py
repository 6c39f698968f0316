"""Bamba (the Mamba2 / attention hybrid) for inference over a flattened token batch (oracle:
transformers' BambaForCausalLM).

Each layer: h += mixer(input_layernorm(h)); h += MLP(pre_ff_layernorm(h)), where the mixer is
either attention (partial rotary: RoPE on the first partial_rotary_factor * head_dim channels,
paged KV) or a Mamba2 mixer whose states live in an SSMCache slot per sequence:

* prefill sequences: one `mamba2_prefill` each, continuing from the slot's state (chunked prefill),
  and the final state is written to the slot at once (with the states on the snapshot grid the
  prefix cache wants, `ssm.prefill_counts`, held in the cache: state/ssm_snapshots.py); prompts padded
  to one length (a prefill graph's) in one `mamba2_prefill_padded`;
* decode / verify sequences (q = 1 or K+1 tokens): one batched `mamba2_multi_step` (shorter
  sequences padded at the end: states are causal, the padding never reaches an accepted state),
  the per-token states staged with `ssm.stage`; the engine calls `ssm.commit(slots, num_accepted)`
  after acceptance. In a static batch (CUDA graphs) even a plain decode's state is staged: the forward
  writes every token's states into the runner's staged buffer (specialists/staged_states.py), which
  the runner stages after the graph; no slot is written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from specialists.models.batch import ForwardBatch
from specialists.models.llama import (
    AttentionWeights, DecoderBase, MLPWeights, Rope, attention_block, fold_gain_, fold_norm_gain, folds_norm_gains,
    fused_attention, fused_mlp, fused_step, mlp_block, rms_norm,
)
from specialists.ops.mamba2 import Mamba2Params, mamba2_prefill, mamba2_prefill_at
from specialists.ops.mamba2_padded import mamba2_prefill_padded
from specialists.ops.mamba2_steps import fused_mamba, fused_mamba_layers, mamba2_multi_step, mamba2_verify

__all__ = ["BambaModel"]


@dataclass
class _BambaLayer:
    input_norm: torch.Tensor  # [d]
    pre_ff_norm: torch.Tensor  # [d]
    mlp: MLPWeights
    attn: AttentionWeights | None = None
    mamba: Mamba2Params | None = None
    cache_index: int = 0  # index among the attention layers (KV) or the Mamba layers (SSM)


def _fold_in_proj(p: Mamba2Params, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """A Mamba layer's input RMSNorm gain folded into a copy of its in_proj (llama.fold_gain_): the decode
    path's in_proj streams h under the norm's scale (one norm kernel fewer a layer); -> the norm's gain
    (ones). A copy: Mamba2Params holds the caller's tensor (a state dict's, a transformers mixer's, shared
    where it already had the model's device and dtype), which must keep its values."""
    p.in_proj_weight = p.in_proj_weight.clone()
    ones = fold_gain_(p.in_proj_weight, gain)
    p.folded_norm_eps = eps
    return ones


class BambaModel(DecoderBase):
    family = "bamba"

    def __init__(self, config: Any, sd: Mapping[str, torch.Tensor], device: str | torch.device = "cpu") -> None:
        super().__init__(config, sd, device, "model.final_layernorm.weight")
        self.layers: list[_BambaLayer] = []
        n_attn = n_mamba = 0
        for i, kind in enumerate(config.layers_block_type):
            p = f"model.layers.{i}."
            layer = _BambaLayer(sd[p + "input_layernorm.weight"], sd[p + "pre_ff_layernorm.weight"],
                                MLPWeights.from_state_dict(sd, p + "feed_forward."))
            if kind == "full_attention":
                layer.attn = AttentionWeights.from_state_dict(sd, p + "self_attn.", config.num_attention_heads,
                                                              config.num_key_value_heads, self.head_dim)
                layer.cache_index, n_attn = n_attn, n_attn + 1
            elif kind == "linear_attention":
                layer.mamba = Mamba2Params.from_state_dict(sd, config, p + "mamba.")
                layer.cache_index, n_mamba = n_mamba, n_mamba + 1
            else:
                raise ValueError(f"layer {i}: unknown block type {kind!r}")
            self.layers.append(layer)
        self._n_attn, self._n_mamba = n_attn, n_mamba
        if folds_norm_gains(self.embed):
            for layer in self.layers:
                if layer.attn is not None:
                    layer.input_norm = fold_norm_gain(layer.attn, layer.input_norm)
                elif os.environ.get("CANTATA_FOLD_MAMBA_NORM", "1") != "0":
                    layer.input_norm = _fold_in_proj(layer.mamba, layer.input_norm, self.eps)
                layer.pre_ff_norm = fold_norm_gain(layer.mlp, layer.pre_ff_norm)
        self.rope = Rope(config, self.head_dim, self.device)
        self.dtype = self.embed.dtype

    @property
    def num_attention_layers(self) -> int:
        return self._n_attn

    @property
    def num_mamba_layers(self) -> int:
        return self._n_mamba

    def _mamba_static(self, p: Mamba2Params, layer: int, x: torch.Tensor | None, batch: ForwardBatch, ssm,
                      residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """A static batch (rows of q tokens each, CUDA graphs): states read through the device slot
        tensor, nothing written; the per-token states go to the batch's staged buffer views
        (batch.staged_out [Bp, q, L, ...], specialists/staged_states.py), where the commit takes one
        token's states of every layer in one go. With `residual` (the decode path, fused_mamba_layers): the
        mixer's output is added to it in out_proj (ops/mamba2_fused.mamba2_layer_fused); None returned."""
        B, q = batch.num_seqs, batch.max_query_len
        out = batch.staged_out
        carry = getattr(batch, "ssm_carry", None)  # a multi-step decode's states after its step before
        if carry is not None:  # [Bp, L, ...] views of the step before's staged token
            conv, state, slots = carry.conv[:, layer], carry.ssm[:, layer], None
        else:
            conv, state, slots = ssm.conv[:, layer], ssm.ssm[:, layer], batch.ssm_slots
        staged = (out.conv[:, :, layer], out.ssm[:, :, layer])
        if residual is not None:
            from specialists.ops.mamba2_fused import mamba2_layer_fused  # Triton: a GPU install has it

            return mamba2_layer_fused(p, x, residual, B, q, conv, state, slots, staged)
        y, _, _ = mamba2_multi_step(p, x.view(B, q, -1), conv, state, slots=slots, out=staged)
        return y.reshape(B * q, -1)

    def _mamba_padded(self, p: Mamba2Params, layer: int, x: torch.Tensor, batch: ForwardBatch, ssm) -> torch.Tensor:
        """Prompts padded to one length (batch.fresh_rows or context_rows, specialists/prefill_graph.py):
        from the states in their slots (zeros, or a prefix hit's snapshot), each row's state after its
        prompt written to its slot here (padding rows: the scratch slot), the snapshot grid's states to
        batch.held_out [Bp, k, L, ...] (ops/mamba2_padded.py)."""
        B, n, held, slots = batch.num_seqs, batch.max_query_len, batch.held_out, batch.ssm_slots
        lens = batch.context_lens.long() - batch.positions.view(B, n)[:, 0]  # each row's new tokens
        y, conv, state, conv_at, ssm_at = mamba2_prefill_padded(
            p, x.view(B, n, -1), lens, held.stride if held is not None else 0,
            ssm.conv[:, layer].index_select(0, slots), ssm.ssm[:, layer].index_select(0, slots))
        ssm.conv[:, layer].index_copy_(0, slots, conv.to(ssm.conv.dtype))
        ssm.ssm[:, layer].index_copy_(0, slots, state)
        if conv_at is not None:
            held.conv[:, :, layer].copy_(conv_at)
            held.ssm[:, :, layer].copy_(ssm_at)
        return y

    def _mamba(self, p: Mamba2Params, layer: int, x: torch.Tensor, batch: ForwardBatch, ssm) -> torch.Tensor:
        """x [T, d] normed -> mixer output [T, d]; prefills write their slots, the rest is staged."""
        if batch.static:
            return self._mamba_static(p, layer, x, batch, ssm)
        if batch.fresh_rows or batch.context_rows:
            return self._mamba_padded(p, layer, x, batch, ssm)
        out = torch.empty_like(x)
        qsl = [0]  # host copies: no device sync inside the forward
        for n in batch.query_lens:
            qsl.append(qsl[-1] + n)
        slots = batch.ssm_slot_list or batch.ssm_slots.tolist()
        steps = [b for b in range(batch.num_seqs) if not batch.is_prefill[b]]
        for b in range(batch.num_seqs):
            if not batch.is_prefill[b]:
                continue
            s, e = qsl[b], qsl[b + 1]
            conv, state = ssm.read(layer, [slots[b]])
            at = ssm.prefill_counts(slots[b])  # block boundaries inside the prefill (prefix-cache snapshots)
            if at:
                y, conv, state, conv_at, ssm_at = mamba2_prefill_at(p, x[s:e], conv[0], state[0], at)
                ssm.hold(layer, slots[b], conv_at, ssm_at)
            else:
                y, conv, state = mamba2_prefill(p, x[s:e], conv[0], state[0])
            out[s:e] = y
            ssm.write(layer, [slots[b]], conv, state)
        if steps:
            qmax = max(batch.query_lens[b] for b in steps)
            rows = torch.tensor(steps, dtype=torch.long, device=x.device)  # seq index -> row
            row_of = torch.full((batch.num_seqs,), -1, dtype=torch.long, device=x.device)
            row_of[rows] = torch.arange(len(steps), device=x.device)
            tok = torch.cat([torch.arange(qsl[b], qsl[b + 1], device=x.device) for b in steps])  # [T_steps]
            r, c = row_of[batch.token_seq[tok]], batch.token_qidx[tok]
            u = x.new_zeros(len(steps), qmax, x.shape[1])  # [B_steps, qmax, d], padded at the end
            u[r, c] = x[tok]
            step_slots = [slots[b] for b in steps]
            conv, state = ssm.read(layer, step_slots)
            # a verify keeps factors (the committed state is built at commit); a decode its one state; on
            # CUDA both run the fused recurrence (mamba2_fused.py), which keeps every token's state
            step = mamba2_multi_step if qmax == 1 or fused_mamba(x.device) else mamba2_verify
            y, convs, states = step(p, u, conv, state)
            out[tok] = y[r, c]
            n = len(steps) - batch.num_pad  # padding rows (the last ones) keep nothing
            if qmax == 1:  # plain decodes: their one token is always committed, so write it now
                ssm.write(layer, step_slots[:n], convs[:n, 0], states[:n, 0])
            else:
                if n < len(steps):  # a tensor of every token's states (the fused step) or StateFactors
                    states = states[:n] if isinstance(states, torch.Tensor) else states.rows(n)
                ssm.stage(layer, step_slots[:n], convs[:n], states)
        return out

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, kv, ssm=None) -> torch.Tensor:  # -> hidden [T, d], final-normed
        if self._n_mamba and ssm is None:
            raise ValueError("a Bamba forward needs an SSMCache")
        h = self.embed[batch.input_ids]
        cos, sin = self.rope.cos_sin(batch.positions, h.dtype)
        fused = fused_step(h)  # decodes and verifies on CUDA in half precision: fewer kernels
        for layer in self.layers:
            i = layer.cache_index
            if layer.attn is not None and fused:
                fused_attention(layer.attn, layer.input_norm, self.eps, h, cos, sin, kv.k[i], kv.v[i], batch)
            elif layer.attn is not None:
                h = h + attention_block(layer.attn, rms_norm(h, layer.input_norm, self.eps), cos, sin, kv.k[i], kv.v[i], batch)
            elif fused and batch.static and fused_mamba_layers(h.device):  # x None: in_proj carries the norm
                x = None if layer.mamba.folded_norm_eps is not None else rms_norm(h, layer.input_norm, self.eps)
                self._mamba_static(layer.mamba, i, x, batch, ssm, residual=h)
            else:
                h = h + self._mamba(layer.mamba, i, rms_norm(h, layer.input_norm, self.eps), batch, ssm)
            if fused:
                fused_mlp(layer.mlp, layer.pre_ff_norm, self.eps, h)
            else:
                h = h + mlp_block(layer.mlp, rms_norm(h, layer.pre_ff_norm, self.eps))
        return rms_norm(h, self.norm, self.eps)

    __call__ = forward
