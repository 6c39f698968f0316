"""The CUDA backend of paged attention (specialists/ops/attention.py): for static batches (decode and
verify steps, CUDA graphs) in half precision, one Triton kernel reads each query's keys straight
from the paged pool through the block table (specialists/ops/fused.py `paged_attention`, which the
drafter uses too): no gathered [B, width] context, no masks, ~12 kernels fewer per layer.

Each query token is one program per KV head over keys [0, position], in fp32, so a token's result
does not depend on how many tokens its row verifies (1 or K+1) nor on the step's context width:
a verify computes the attention a plain decode of that token would. Prefills, mixed steps and fp32
models keep the torch path (the CUDA tests of the toys compare eager and static steps in fp32).
"""

from __future__ import annotations

import torch

from specialists.models.batch import ForwardBatch

__all__ = ["paged_attention_static", "use_static_kernel"]

HALF = (torch.bfloat16, torch.float16)


def use_static_kernel(q: torch.Tensor, batch: ForwardBatch) -> bool:
    """Whether this call takes the kernel: a static batch in half precision (on CUDA, or on CPU
    tensors under TRITON_INTERPRET=1 in tests)."""
    return batch.static and q.dtype in HALF


def paged_attention_static(
    q: torch.Tensor,  # [Tp, H_q, D], rows of max_query_len tokens each
    k_cache_layer: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache_layer: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    batch: ForwardBatch,
    scale: float | None = None,
) -> torch.Tensor:  # [Tp, H_q, D]
    from specialists.ops import fused  # Triton: imported on first use

    d = q.shape[-1]
    return fused.paged_attention(q, k_cache_layer, v_cache_layer, batch.block_tables, batch.positions, 1,
                                 d ** -0.5 if scale is None else scale, batch.max_query_len, batch.max_context_len)
