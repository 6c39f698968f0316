"""Attention over the paged KV pool: write the new tokens' K/V, then causal attention of each
sequence's new tokens over its whole context (1 token for decode, K+1 for verify, many for prefill),
with grouped-query heads.

The torch reference gathers each sequence's context through its block table into a padded
[B, max_ctx] layout and runs one masked SDPA call for the whole batch: no Python loop over
tokens. Context slots past a sequence's length (the rest of its last block, the table padding) are
zeroed after the gather (on CPU row by row, on CUDA and in a static batch by one mask), so whatever the pool holds there (stale tails, other
sequences' blocks, NaN) never reaches a result. Backends are picked per device at call time:
on CUDA, static half-precision batches (decode and verify graphs) read the pool directly through a
Triton kernel (attention_cuda.py); everything else takes the torch path.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from specialists.models.batch import ForwardBatch

__all__ = ["write_kv", "paged_attention", "paged_attention_torch", "grouped_attention", "workspace", "sdpa"]


def write_kv(
    k: torch.Tensor,  # [T, H_kv, D]
    v: torch.Tensor,  # [T, H_kv, D]
    k_cache_layer: torch.Tensor,  # [num_blocks, block_size, H_kv, D], written in place
    v_cache_layer: torch.Tensor,  # [num_blocks, block_size, H_kv, D], written in place
    slot_mapping: torch.Tensor,  # [T] int64 flat slots (block * block_size + offset)
) -> None:
    nb, bs, h, d = k_cache_layer.shape
    k_cache_layer.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache_layer.dtype))
    v_cache_layer.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache_layer.dtype))


# cuDNN's SDPA backend builds an execution plan on the host for every new shape: ~1.7 ms a call on an
# H100's host, so a 30-layer prefill of a new prompt length took ~60 ms at SmolLM2-135M (2026-11-26),
# and every prompt's length is new. The memory-efficient kernel plans nothing, takes a mask, and needs
# the KV heads repeated for grouped queries; without it (a shape it refuses) the math backend serves.
_NO_CUDNN = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool = False, **kw: Any) -> torch.Tensor:
    """F.scaled_dot_product_attention (q [B, H, T, D], k / v [B, H_kv, S, D]); on CUDA without the
    cuDNN backend (see _NO_CUDNN), grouped KV heads repeated for the memory-efficient kernel, except
    under a CausalBias (a one-sequence prefill), which flash attention takes with the heads as they are."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa, **kw)
    if isinstance(kw.get("attn_mask"), CausalBias):  # flash attention reads grouped KV heads as they are
        with sdpa_kernel(_NO_CUDNN):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa, **kw)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    with sdpa_kernel(_NO_CUDNN):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def paged_attention_torch(
    q: torch.Tensor,  # [T, H_q, D]
    k_cache_layer: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache_layer: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    batch: ForwardBatch,
    scale: float | None = None,
    fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # [T, H_q, D]
    """fresh: the step's own k and v [T, H_kv, D] as written to the pool; a one-sequence prefill with
    nothing cached before it attends over them instead of gathering them back (the same values)."""
    T, hq, d = q.shape
    hkv = k_cache_layer.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    B, max_q, max_ctx = batch.num_seqs, batch.max_query_len, batch.max_context_len
    own = fresh if fresh is not None and attends_own_kv(batch) and k_cache_layer.dtype == q.dtype else None
    k, v, invalid, mask = _context_kv(k_cache_layer, v_cache_layer, batch, q.device, own)  # [B, max_ctx, H_kv, D]
    if (B > 1 or batch.static) and invalid is not None:  # one sequence (or own k/v on CUDA): nothing to zero
        if k.device.type == "cpu" and not batch.static:  # zero just each row's tail (~6% faster at batch 8; lengths cost no sync here)
            for b, n in enumerate(batch.context_lens.tolist()):
                if n < max_ctx:
                    k[b, n:] = 0
                    v[b, n:] = 0
        else:  # in place: the gathered copies are ours
            k.masked_fill_(invalid, 0)
            v.masked_fill_(invalid, 0)
    k, v = k.to(q.dtype), v.to(q.dtype)
    if batch.row_exact and not batch.static and q.device.type == "cpu":
        return _rows_as_decodes(q, k, v, batch, scale, hq != hkv)
    if batch.context_rows and _flash_varlen(q):  # prefix hits' padded prefill
        return _after_hit(q, k, v, batch, scale)
    if batch.static:  # rows of one length (a CUDA graph's batch): two batched products, few kernels
        bias = _static_bias(batch, mask, q.dtype)
        return grouped_attention(q.view(B, max_q, hq, d), k, v, bias, d ** -0.5 if scale is None else scale).view(T, hq, d)

    # queries, padded: [B, max_q, H_q, D]; padded rows sit at position 0 (one valid key, no NaN)
    if max_q == 1:  # decode: one token per sequence, in sequence order
        qp = q[:, None]
    elif B == 1 or batch.static or batch.fresh_rows or batch.context_rows:  # one sequence, or rows of one length: in order
        qp = q.view(B, max_q, hq, d)
    else:
        qp = q.new_zeros(B, max_q, hq, d)
        qp[batch.token_seq, batch.token_qidx] = q

    if q.is_cuda and (B == 1 or batch.fresh_rows) and max_q > 1 and batch.is_prefill[0] and not batch.context_rows:  # they end its context
        mask = causal_lower_right(max_q, max_ctx)  # flash attention takes it; a tensor mask it refuses
        # (a verify keeps the tensor mask, the path a decode of the same sequence takes)
    out = sdpa(
        qp.transpose(1, 2),  # [B, H_q, max_q, D]
        k.transpose(1, 2),  # [B, H_kv, max_ctx, D]
        v.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=hq != hkv,
    )  # [B, H_q, max_q, D]
    if max_q == 1:
        return out[:, :, 0]  # [T = B, H_q, D]
    if B == 1 or batch.static or batch.fresh_rows or batch.context_rows:
        return out.transpose(1, 2).reshape(T, hq, d)  # [T, H_q, D]
    return out.transpose(1, 2)[batch.token_seq, batch.token_qidx]  # [T, H_q, D]


def _flash_varlen(q: torch.Tensor) -> bool:
    """Whether flash attention runs q: CUDA, half precision, an sm80+ device, head dim <= 256 and a multiple of 8."""
    return (q.is_cuda and q.dtype in HALF and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0
            and _capability(q.device.index if q.device.index is not None else torch.cuda.current_device()) >= (8, 0))


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _after_hit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, scale: float | None) -> torch.Tensor:
    """Prompts' new tokens after prefix hits, each row padded to max_query_len n (batch.context_rows), over
    their contexts k, v [B, W, H_kv, D] gathered at the static width W: flash attention's variable-length
    form, whose lengths are device tensors (a CUDA graph's): row b's n queries over its first c_b + n keys
    (seqused_k), causal from the bottom right, so its token i sees keys [0, c_b + i]; the padding's rows
    (i past the row's new tokens, the keys they see zeroed by _context_kv's mask) come out zero. The
    memory-efficient kernel with a position mask took ~115 us a layer here at a 2,048-key context on an
    H100 (a program per 64 queries and head walks every key; bench/RESULTS.md, session 26)."""
    T, hq, d = q.shape
    B, W = k.shape[:2]
    n = T // B
    cache = batch.__dict__["_attn_meta"]
    if "hit" not in cache:  # once per step: row starts of q and k, keys used per row, the real query rows
        first = batch.positions.view(B, n)[:, 0].int()  # c_b
        new = batch.context_lens[:B].int() - first  # each row's new tokens
        rows = torch.arange(B + 1, device=q.device, dtype=torch.int32)
        cache["hit"] = (rows * n, rows * W, first + n,
                        (torch.arange(n, device=q.device)[None, :] < new[:, None]).reshape(T, 1, 1))
    cu_q, cu_k, used, real = cache["hit"]
    out = torch.ops.aten._flash_attention_forward(q, k.reshape(B * W, *k.shape[2:]), v.reshape(B * W, *v.shape[2:]), cu_q,
                                                  cu_k, n, W, 0.0, True, False, seqused_k=used,
                                                  scale=d ** -0.5 if scale is None else scale)[0]
    return torch.where(real, out, 0.0)


def _rows_as_decodes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, scale: float | None,
                     gqa: bool) -> torch.Tensor:
    """Every query row (prefill, decode or verify, any batch) attended alone, exactly as a 1-token
    decode of its position would be: its own sequence's keys [0, position], an all-true mask. So a
    row's result depends on nothing else in the step, bit for bit, which bf16 products downstream need
    (they turn a last-bit difference into a different token). One call per row: for the CPU only."""
    cache = batch.__dict__.setdefault("_attn_meta", {})
    key = ("rows", q.device)
    if key not in cache:  # built once per step, shared by its layers: (row, sequence, keys, all-true mask)
        pos = batch.positions.tolist()
        seq = batch.token_seq.tolist() if batch.num_seqs > 1 else [0] * len(pos)
        masks = {n: torch.ones(1, 1, 1, n, dtype=torch.bool, device=q.device) for n in {p + 1 for p in pos}}
        cache[key] = [(r, b, p + 1, masks[p + 1]) for r, (p, b) in enumerate(zip(pos, seq))]
    outs = [F.scaled_dot_product_attention(q[r:r + 1, None].transpose(1, 2), k[b:b + 1, :n].transpose(1, 2),
                                           v[b:b + 1, :n].transpose(1, 2), attn_mask=mask, scale=scale,
                                           enable_gqa=gqa)[:, :, 0] for r, b, n, mask in cache[key]]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def grouped_attention(
    q: torch.Tensor,  # [B, M, H_q, D]
    k: torch.Tensor,  # [B, N, H_kv, D]
    v: torch.Tensor,  # [B, N, H_kv, D]
    bias: torch.Tensor,  # [B, M, N] additive: 0 where a query sees a key, -inf elsewhere
    scale: float,
) -> torch.Tensor:  # [B, M, H_q, D]
    """Softmax attention with grouped-query heads as two batched products: the H_q / H_kv query
    heads of a KV head (and the M queries) are the rows of one product with that head's keys.
    SDPA with enable_gqa takes its math path at these sizes on CUDA (fp32 with a mask): about 15
    small kernels per call against 7 here, which is what a CUDA graph of tiny kernels pays for."""
    B, M, hq, d = q.shape
    N, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = torch.empty(B, hkv, M, g, d, dtype=q.dtype, device=q.device)
    torch.mul(q.view(B, M, hkv, g, d).permute(0, 2, 1, 3, 4), scale, out=qg)  # [B, H_kv, M, G, D], scaled
    s = torch.matmul(qg.view(B, hkv, M * g, d), k.permute(0, 2, 3, 1))  # [B, H_kv, M*G, N]
    p = (s.view(B, hkv, M, g, N) + bias[:, None, :, None, :]).softmax(-1)
    o = torch.matmul(p.view(B, hkv, M * g, N), v.transpose(1, 2))  # [B, H_kv, M*G, D]
    return o.view(B, hkv, M, g, d).permute(0, 2, 1, 3, 4).reshape(B, M, hq, d)


def _static_bias(batch: ForwardBatch, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form [B, max_q, max_ctx] of a static batch's causal mask, built once per batch."""
    cache = batch.__dict__["_attn_meta"]
    key = ("bias", dtype)
    if key not in cache:
        m = mask[:, 0]
        cache[key] = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
    return cache[key]


_LOCAL = threading.local()  # per thread: engines in one process may step in different threads


def workspace(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor of `shape` from a buffer reused across calls (per thread, name, dtype).
    On CPU a fresh multi-hundred-KB temporary per layer is mmap'd and page-faulted every time (it made
    the context gather ~9x slower at batch 8); CUDA's caching allocator needs no help. The caller
    must be done with the previous tensor of that name."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    bufs = _LOCAL.__dict__.setdefault("bufs", {})
    n = math.prod(shape)
    ws = bufs.get((name, dtype))
    if ws is None or ws.numel() < n:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            ws = bufs[name, dtype] = torch.empty(max(n, 2 * (0 if ws is None else ws.numel())), dtype=dtype)
    return ws[:n].view(shape)


def _gather(pool: torch.Tensor, flat: torch.Tensor, name: str) -> torch.Tensor:
    """pool.index_select(0, flat) into a reused buffer: consumed by the same layer's SDPA before the
    next gather of that name."""
    out = workspace(name, (flat.numel(), *pool.shape[1:]), pool.dtype, pool.device)
    return torch.index_select(pool, 0, flat, out=out)


def attends_own_kv(batch: ForwardBatch) -> bool:
    """A one-sequence prefill with nothing cached before it (its new tokens are its whole context), or
    rows of such prompts padded to one length (batch.fresh_rows), not static and not row-exact (those
    rows keep the pool's layout): paged_attention_torch takes its own k and v (`fresh`) instead of
    gathering them back from the pool."""
    return ((batch.num_seqs == 1 or batch.fresh_rows) and batch.max_query_len == batch.max_context_len
            and not batch.static and not batch.row_exact)


def _context_kv(k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor, batch: ForwardBatch, device: torch.device,
                own: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
    """The context K/V of every sequence, padded: [B, max_ctx, H_kv, D], gathered from the pool, or a
    one-sequence prefill's own k and v (`own`, given when attends_own_kv) as they are; with the
    metadata's mask of slots past each context and causal mask (_metadata). On CUDA `own` needs
    neither (flash attention's causal bias): no block table or context length is read, which a
    prefill graph's padded length (specialists/prefill_graph.py) relies on."""
    B, max_ctx = batch.num_seqs, batch.max_context_len
    if own is not None:
        k, v = (t.view(B, max_ctx, *t.shape[1:]) for t in own)
        return (k, v, None, None) if device.type == "cuda" else (k, v, *_metadata(batch, k_cache_layer.shape[1], device)[1:])
    flat, invalid, mask = _metadata(batch, k_cache_layer.shape[1], device)
    hkv, d = k_cache_layer.shape[2], k_cache_layer.shape[3]
    k = _gather(k_cache_layer, flat, "attn.k").reshape(B, -1, hkv, d)[:, :max_ctx]
    v = _gather(v_cache_layer, flat, "attn.v").reshape(B, -1, hkv, d)[:, :max_ctx]
    return k, v, invalid, mask


def _metadata(batch: ForwardBatch, bs: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every attention layer of a step (and the drafter's rebuild) shares, built once per batch:
    the flat block ids to gather [B * nblk], the mask of slots past each context [B, max_ctx, 1, 1]
    and the causal mask [B, 1, max_q, max_ctx]."""
    key = (bs, device)
    cache = batch.__dict__.setdefault("_attn_meta", {})
    if key in cache:
        return cache[key]
    B, max_q, max_ctx = batch.num_seqs, batch.max_query_len, batch.max_context_len
    nblk = -(-max_ctx // bs)
    table = batch.block_tables[:, :nblk].long()  # [B, nblk]
    if table.shape[1] < nblk:
        raise ValueError(f"block tables have {table.shape[1]} columns, contexts need {nblk}")
    flat = table.reshape(-1).to(device)  # index_select: about 2x faster than advanced indexing on CPU
    j = torch.arange(max_ctx, device=device)
    ctx = batch.context_lens.to(device).long()  # [B]
    invalid = (j[None, :] >= ctx[:, None])[..., None, None]  # [B, max_ctx, 1, 1]
    if max_q == 1 or batch.static or batch.context_rows:  # rows of one length: the positions in row order
        qpos = batch.positions.to(device).view(B, max_q)  # [B, max_q]
    else:
        qpos = torch.zeros(B, max_q, dtype=torch.long, device=device)
        qpos[batch.token_seq, batch.token_qidx] = batch.positions
    mask = (j[None, None, :] <= qpos[..., None])[:, None]  # [B, 1, max_q, max_ctx], causal within the context
    cache[key] = (flat, invalid, mask)
    return cache[key]


HALF = (torch.bfloat16, torch.float16)


def use_static_kernel(q: torch.Tensor, batch: ForwardBatch) -> bool:
    """Whether a call takes attention_cuda.py's kernels: a static batch in half precision (on CUDA,
    or on CPU tensors under TRITON_INTERPRET=1 in tests)."""
    return batch.static and q.dtype in HALF


def _paged_attention_cuda(q: torch.Tensor, k_cache_layer: torch.Tensor, v_cache_layer: torch.Tensor,
                          batch: ForwardBatch, scale: float | None = None, fresh=None) -> torch.Tensor:
    """Static half-precision batches through the Triton kernel (attention_cuda.py), the rest in torch."""
    if use_static_kernel(q, batch):
        from specialists.ops.attention_cuda import paged_attention_static  # Triton: a GPU install has it

        return paged_attention_static(q, k_cache_layer, v_cache_layer, batch, scale)
    return paged_attention_torch(q, k_cache_layer, v_cache_layer, batch, scale, fresh)


# device type -> implementation
_BACKENDS: dict[str, Callable[..., torch.Tensor]] = {
    "cpu": paged_attention_torch,
    "cuda": _paged_attention_cuda,
}


def paged_attention(
    q: torch.Tensor,  # [T, H_q, D]
    k_cache_layer: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache_layer: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    batch: ForwardBatch,
    scale: float | None = None,  # default D ** -0.5
    fresh: tuple[torch.Tensor, torch.Tensor] | None = None,  # the step's k, v [T, H_kv, D] (paged_attention_torch)
) -> torch.Tensor:  # [T, H_q, D]
    """Causal attention of each sequence's new tokens (already written with write_kv) over its
    context [0, context_len) in the paged pool."""
    impl = _BACKENDS.get(q.device.type, paged_attention_torch)
    return impl(q, k_cache_layer, v_cache_layer, batch, scale, fresh)
