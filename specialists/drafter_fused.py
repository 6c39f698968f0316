"""The MTP drafter's static paths through Triton kernels (specialists/ops/fused.py), mixed into
`PagedDrafter` (specialists/drafter.py): on CUDA a static rebuild and a static chain run the drafter's
layer as 7 kernels (RMSNorm + product with a residual / token-row / SwiGLU epilogue; q/k/v with RoPE
and K/V written to the pool; paged attention with per-token limits) plus the head's argmax. They read
the drafter's folded weights (w_*), token_proj, pools k / v, RoPE table _cs and `_fused` (the ops module).
"""

from __future__ import annotations

import torch

from specialists.models.batch import ForwardBatch

ENTRY_ROWS = 1024  # the most tokens a static batch has (64 rows x 16 tokens)


class FusedPaths:
    """PagedDrafter's fused static rebuild and chain (see the module docstring)."""

    def _layer_fused(self, x: torch.Tensor, o: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rest of the block after attention: x + o_proj(o), then the SwiGLU MLP with its residual."""
        f = self._fused
        x2 = f.rows_linear(o.reshape(x.shape[0], -1), self.w_o, residual=x)
        h = f.rows_linear(x2, self.w_gate_up, norm_eps=self.eps, silu_mul=True)
        return f.rows_linear(h, self.w_down, residual=x2, out=out)

    def _head_fused(self, out: torch.Tensor) -> torch.Tensor:  # [B, d] -> greedy draft ids [B]
        best = self._fused.rows_linear(out, self.w_head, norm_eps=self.eps).argmax(-1)
        return best if self.vocab is None else self.vocab[best]

    def _rebuild_fused(self, batch: ForwardBatch, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """`rebuild` for a static batch (every row max_query_len tokens, padding rows in the scratch block)."""
        f, cfg = self._fused, self.cfg
        x = f.rows_linear(hidden, self.w_hidden, norm_eps=self.eps, tokens=next_tokens, table=self.token_proj)
        q = f.qkv_rope(x, self.w_qkv, self._cs, self.k, self.v, cfg.num_attention_heads, cfg.num_key_value_heads,
                       self.eps, positions=batch.positions, pos_add=1, slots=batch.slot_mapping)
        o = f.paged_attention(q, self.k, self.v, batch.block_tables, batch.positions, 1, self.scale,
                              batch.max_query_len, batch.max_context_len)
        T = x.shape[0]
        return self._layer_fused(x, o, out=self._entries[:T] if T <= ENTRY_ROWS else None)

    def _chain_fused(self, prev: torch.Tensor, c: torch.Tensor, tables: torch.Tensor, k: int, width: int) -> torch.Tensor:
        """chain_static's drafts [B, k] through Triton kernels. Unlike `_chain`, the chained entries
        go to the pool, at their own indices C + depth - 2: slots the verify reserved and the rebuild
        overwrites after it (padding rows: the scratch block)."""
        f, cfg = self._fused, self.cfg
        drafts = [self._head_fused(prev)]
        for depth in range(2, k + 1):
            x = f.rows_linear(prev, self.w_hidden, norm_eps=self.eps, tokens=drafts[-1], table=self.token_proj)
            q = f.qkv_rope(x, self.w_qkv, self._cs, self.k, self.v, cfg.num_attention_heads, cfg.num_key_value_heads,
                           self.eps, committed=c, tables=tables, entry_add=depth - 2)
            o = f.paged_attention(q, self.k, self.v, tables, c, depth - 1, self.scale, 1, width + k)
            prev = self._layer_fused(x, o)
            drafts.append(self._head_fused(prev))
        return torch.stack(drafts, dim=1)
