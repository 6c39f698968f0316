"""Triton kernels for grammar masks on a GPU: one launch where the torch ops take ten or more.

  apply_bitmask   logits [R, V] in place: row r keeps the tokens its bitmask row allows (-inf
                  elsewhere), plus `bonus` where the row's close flag is set (spec/grammar.py's
                  closing preference near a reply's budget end)
  masked_argmax   a drafter's logits [B, N] over its draft vocabulary: the greedy draft under each
                  row's bitmask over the full vocabulary, and the draft without it (how often the
                  mask changed the drafter's choice is a reported stat); both as full-vocabulary ids

Bitmasks are xgrammar's layout: int32 words, bit b of word w allows token 32 w + b. `apply_bitmask`
reads [R, W + 1] words: the row's W mask words, then its close flag. Ties go to the lowest index, like
torch.argmax. With TRITON_INTERPRET=1 (set before this module is imported) they run on CPU tensors,
which is how CI tests them against the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["apply_bitmask", "masked_argmax"]

_BLOCK = 1024


@triton.jit
def _apply_kernel(logits_ptr, stride_l, bits_ptr, stride_b, bonus_ptr, V, W, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = idx < V
    word = tl.load(bits_ptr + row * stride_b + idx // 32, mask=m, other=0)
    ok = ((word >> (idx % 32)) & 1) != 0
    flag = tl.load(bits_ptr + row * stride_b + W)
    x = tl.load(logits_ptr + row * stride_l + idx, mask=m, other=0.0)
    bonus = tl.load(bonus_ptr + idx, mask=m & (flag != 0), other=0.0)
    y = tl.where(ok, x.to(tl.float32) + bonus.to(tl.float32), float("-inf"))  # one rounding, in fp32
    tl.store(logits_ptr + row * stride_l + idx, y.to(x.dtype), mask=m)


def apply_bitmask(logits: torch.Tensor, words: torch.Tensor, bonus: torch.Tensor) -> None:
    """logits [R, V] (in place); words [R, W + 1] int32 on its device (mask words, then a close flag);
    bonus [>= V] float32 (the sum is rounded once to the logits' dtype), added where a row's flag is set."""
    R, V = logits.shape
    if R == 0:
        return
    assert logits.stride(1) == 1 and words.is_contiguous() and words.shape[0] == R
    W = words.shape[1] - 1
    _apply_kernel[(R, triton.cdiv(V, _BLOCK))](logits, logits.stride(0), words, words.stride(0), bonus, V, W, BLOCK=_BLOCK)


@triton.jit
def _best(x, idx, best_v, best_i):
    """The block's max of x and its lowest index, folded into (best_v, best_i) (an earlier block wins ties)."""
    v = tl.max(x, 0)
    i = tl.min(tl.where(x == v, idx, 2147483647), 0)
    better = v > best_v
    return tl.where(better, v, best_v), tl.where(better, i, best_i)


@triton.jit
def _masked_argmax_kernel(logits_ptr, stride_l, bits_ptr, stride_b, vocab_ptr, best_ptr, free_ptr, N: tl.constexpr,
                          HAS_VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    best_v = tl.full([], float("-inf"), tl.float32)
    free_v = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32)
    free_i = tl.full([], 0, tl.int32)
    for n0 in range(0, N, BLOCK):
        idx = n0 + tl.arange(0, BLOCK)
        m = idx < N
        x = tl.load(logits_ptr + row * stride_l + idx, mask=m, other=float("-inf")).to(tl.float32)
        if HAS_VOCAB:
            tok = tl.load(vocab_ptr + idx, mask=m, other=0).to(tl.int32)
        else:
            tok = idx
        word = tl.load(bits_ptr + row * stride_b + tok // 32, mask=m, other=0)
        ok = ((word >> (tok % 32)) & 1) != 0
        free_v, free_i = _best(x, idx, free_v, free_i)
        best_v, best_i = _best(tl.where(ok, x, float("-inf")), idx, best_v, best_i)
    if HAS_VOCAB:
        best_i = tl.load(vocab_ptr + best_i).to(tl.int32)
        free_i = tl.load(vocab_ptr + free_i).to(tl.int32)
    tl.store(best_ptr + row, best_i.to(tl.int64))
    tl.store(free_ptr + row, free_i.to(tl.int64))


def masked_argmax(logits: torch.Tensor, words: torch.Tensor, vocab: torch.Tensor | None,
                  best: torch.Tensor, free: torch.Tensor) -> None:
    """logits [B, N] (N: the draft vocabulary, ids `vocab` [N] int64, None: the full one); words [B, W]
    int32 bitmasks over the full vocabulary -> best [B] and free [B] int64 (written): the masked and
    unmasked argmax as full-vocabulary ids. A row whose mask allows none of the N gets the unmasked
    position 0's id (the grammar then refuses it and the row's drafts end there)."""
    B, N = logits.shape
    assert logits.stride(1) == 1 and words.stride(1) == 1
    _masked_argmax_kernel[(B,)](logits, logits.stride(0), words, words.stride(0), logits if vocab is None else vocab,
                                best, free, N, HAS_VOCAB=vocab is not None, BLOCK=_BLOCK)
