"""Parts of the MTP drafter at inference (specialists/drafter.py): its folded weights, its RoPE table,
and its static paths through Triton kernels (specialists/ops/fused.py). On CUDA a static rebuild and a
static chain run the drafter's layer as 7 kernels (RMSNorm + product with a residual / token-row /
SwiGLU epilogue; q/k/v with RoPE and K/V written to the pool; paged attention with per-token limits)
plus the head's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from specialists.models.batch import ForwardBatch
from specialists.models.mtp import MTPDrafter
from specialists.models.rope import rope_inv_freq, signed_rope_table

ENTRY_ROWS = 1024  # the most tokens a static batch has (64 rows x 16 tokens)


@dataclass
class DrafterWeights:
    """The drafter's weights with each RMSNorm's gain folded into the columns of the product that
    reads it (times `gain`: sqrt(d) on the CPU, where a norm is then x / |x|)."""

    qkv: torch.Tensor  # [(H + 2 H_kv) hd, d] q, k, v in one product
    o: torch.Tensor  # [d, H hd]
    gate_up: torch.Tensor  # [2 ffn, d] gate and up in one product
    down: torch.Tensor  # [d, ffn]
    hidden: torch.Tensor  # [d, d] the hidden half of the input projection
    head: torch.Tensor  # [N, d] the lm_head rows of the draft vocabulary
    token_proj: torch.Tensor  # [V, d] embed_norm(E) W_e^T: the token half of the input projection, per token

    @classmethod
    @torch.no_grad()
    def fold(cls, drafter: MTPDrafter, embed: torch.Tensor, lm_head: torch.Tensor, vocab: torch.Tensor | None,
             gain: float) -> DrafterWeights:
        d, blk, eps = drafter.cfg.hidden_size, drafter.block, drafter.cfg.rms_norm_eps
        dtype = next(drafter.parameters()).dtype

        def fold(w: torch.Tensor, norm) -> torch.Tensor:
            return (w.detach() * (norm.weight.detach() * gain)[None, :]).contiguous()

        # fuse(prev, token) = proj([hidden_norm(prev), embed_norm(emb)]) = W_h hidden_norm(prev) + T[token]
        w = drafter.proj.weight  # [d, 2d]
        emb = F.rms_norm(embed.to(dtype), (d,), drafter.embed_norm.weight, eps)
        head = lm_head if vocab is None else lm_head[vocab]
        return cls(
            qkv=fold(torch.cat([blk.q_proj.weight, blk.k_proj.weight, blk.v_proj.weight]), blk.attn_norm),
            o=blk.o_proj.weight.detach().contiguous(),
            gate_up=fold(torch.cat([blk.gate_proj.weight, blk.up_proj.weight]), blk.mlp_norm),
            down=blk.down_proj.weight.detach().contiguous(),
            hidden=fold(w[:, :d], drafter.hidden_norm),
            head=fold(head, drafter.final_norm),
            token_proj=F.linear(emb, w[:, d:]).contiguous(),
        )


class RopeTable:
    """RoPE per position as [n, 2, 1, hd]: cos, and sin with the rotate-half sign folded in, so that
    x*cos + roll(x, hd/2)*[-sin, sin] equals x*cos + cat(-x2, x1)*sin exactly (a sign flip is exact)."""

    def __init__(self, head_dim: int, theta: float, *, dtype: torch.dtype, device: torch.device, positions: int) -> None:
        self.inv_freq = rope_inv_freq(theta, head_dim, device)
        self.dtype = dtype
        self.table = torch.empty(0, 2, 1, head_dim, device=device)
        self.grow(positions, frozen=False)

    def grow(self, max_pos: int, frozen: bool) -> None:
        """Room for positions 0..max_pos; `frozen` (captured graphs read the table): it must not move."""
        if max_pos < self.table.shape[0]:
            return
        if frozen:
            raise RuntimeError(f"RoPE position {max_pos} past the {self.table.shape[0]} reserved (max_positions)")
        self.table = signed_rope_table(self.inv_freq, max(2 * max_pos, 1024), self.dtype)  # [n, 2, 1, hd]


class FusedDrafter:
    """The drafter's fused static rebuild and chain (see the module docstring)."""

    def __init__(self, ops: ModuleType, weights: DrafterWeights, rope: RopeTable, *, pool: tuple[torch.Tensor, torch.Tensor],
                 heads: tuple[int, int], eps: float, vocab: torch.Tensor | None, entries: torch.Tensor) -> None:
        self.ops, self.w, self.rope = ops, weights, rope
        self.k, self.v = pool  # [blocks, block_size, H_kv, hd] the drafter's paged K / V
        self.num_heads, self.num_kv_heads = heads
        self.eps = eps
        self.scale = self.k.shape[-1] ** -0.5
        self.vocab = vocab  # [N] draft vocabulary ids, or None
        self.entries = entries  # [ENTRY_ROWS, d] where a static rebuild writes its entry outputs

    def _layer(self, x: torch.Tensor, o: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rest of the block after attention: x + o_proj(o), then the SwiGLU MLP with its residual."""
        f, w = self.ops, self.w
        x2 = f.rows_linear(o.reshape(x.shape[0], -1), w.o, residual=x)
        h = f.rows_linear(x2, w.gate_up, norm_eps=self.eps, silu_mul=True)
        return f.rows_linear(h, w.down, residual=x2, out=out)

    def _head(self, out: torch.Tensor) -> torch.Tensor:  # [B, d] -> greedy draft ids [B]
        best = self.ops.rows_linear(out, self.w.head, norm_eps=self.eps).argmax(-1)
        return best if self.vocab is None else self.vocab[best]

    def _qkv(self, x: torch.Tensor, **where) -> torch.Tensor:
        return self.ops.qkv_rope(x, self.w.qkv, self.rope.table, self.k, self.v, self.num_heads, self.num_kv_heads,
                                 self.eps, **where)

    def rebuild(self, batch: ForwardBatch, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """`rebuild` for a static batch (every row max_query_len tokens, padding rows in the scratch block)."""
        f = self.ops
        x = f.rows_linear(hidden, self.w.hidden, norm_eps=self.eps, tokens=next_tokens, table=self.w.token_proj)
        q = self._qkv(x, positions=batch.positions, pos_add=1, slots=batch.slot_mapping)
        o = f.paged_attention(q, self.k, self.v, batch.block_tables, batch.positions, 1, self.scale,
                              batch.max_query_len, batch.max_context_len)
        T = x.shape[0]
        return self._layer(x, o, out=self.entries[:T] if T <= ENTRY_ROWS else None)

    def chain(self, prev: torch.Tensor, c: torch.Tensor, tables: torch.Tensor, k: int, width: int) -> torch.Tensor:
        """A static chain's drafts [B, k]. Unlike the torch chain, the chained entries go to the pool,
        at their own indices C + depth - 2: slots the verify reserved and the rebuild overwrites after
        it (padding rows: the scratch block)."""
        f = self.ops
        drafts = [self._head(prev)]
        for depth in range(2, k + 1):
            x = f.rows_linear(prev, self.w.hidden, norm_eps=self.eps, tokens=drafts[-1], table=self.w.token_proj)
            q = self._qkv(x, committed=c, tables=tables, entry_add=depth - 2)
            o = f.paged_attention(q, self.k, self.v, tables, c, depth - 1, self.scale, 1, width + k)
            prev = self._layer(x, o)
            drafts.append(self._head(prev))
        return torch.stack(drafts, dim=1)
