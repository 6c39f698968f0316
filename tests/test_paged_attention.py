"""paged_attention over a paged pool equals dense causal attention per sequence."""

from __future__ import annotations

import random

import pytest
import torch

from specialists.models.batch import ForwardBatch, SeqStep
from specialists.ops.attention import paged_attention, write_kv
from state.kv_cache import flat_slots


def _dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [q, Hq, D] at positions start.., k/v [ctx, Hkv, D] -> [q, Hq, D], in float64."""
    hq, hkv = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * q.shape[-1] ** -0.5
    qpos = torch.arange(start, start + q.shape[0])[:, None]
    s = s.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).float()


def _case(seed: int, block_size: int, hq: int, hkv: int, q_lens: list[int], garbage: float):
    """Sequences with contexts of random length whose last q_b tokens are new; K/V of the old tokens
    are written through write_kv, the new ones by the test below. Block 0 is never allocated and the
    pool starts full of garbage."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    D = 16
    num_blocks = 96
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    k_pool = torch.full((num_blocks, block_size, hkv, D), garbage)
    v_pool = torch.full((num_blocks, block_size, hkv, D), garbage)
    steps, seqs = [], []
    for sid, q in enumerate(q_lens):
        ctx = q + rng.choice([0, 1, rng.randint(1, 3 * block_size), rng.randint(2 * block_size, 5 * block_size)])
        nblk = -(-ctx // block_size)
        table = [free.pop() for _ in range(nblk)]
        k = torch.randn(ctx, hkv, D, generator=g)
        v = torch.randn(ctx, hkv, D, generator=g)
        qq = torch.randn(q, hq, D, generator=g)
        old = ctx - q
        if old:
            slots = torch.from_numpy(flat_slots(table, 0, old, block_size))
            write_kv(k[:old], v[:old], k_pool, v_pool, slots)
        steps.append(SeqStep(sid, list(range(q)), old, table, is_prefill=q > 6, logits="all"))
        seqs.append((qq, k, v, old))
    return steps, seqs, k_pool, v_pool


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 1), (2, 2)])
@pytest.mark.parametrize("seed,garbage", [(0, float("nan")), (1, 1e30)])
def test_paged_attention_matches_dense(block_size: int, hq: int, hkv: int, seed: int, garbage: float) -> None:
    rng = random.Random(100 + seed)
    q_lens = [rng.choice([1, 1, 5, 5, rng.randint(7, 40)]) for _ in range(rng.randint(1, 6))] + [1, 5, 23]
    rng.shuffle(q_lens)
    steps, seqs, k_pool, v_pool = _case(seed, block_size, hq, hkv, q_lens, garbage)
    batch = ForwardBatch.build(steps, block_size)
    q = torch.cat([s[0] for s in seqs])
    k_new = torch.cat([k[old:] for _, k, _, old in seqs])
    v_new = torch.cat([v[old:] for _, _, v, old in seqs])
    write_kv(k_new, v_new, k_pool, v_pool, batch.slot_mapping)
    out = paged_attention(q, k_pool, v_pool, batch)
    assert out.shape == q.shape
    assert torch.isfinite(out).all(), "garbage of the pool leaked into the result"
    qsl = batch.query_start_loc.tolist()
    for b, (qq, k, v, old) in enumerate(seqs):
        ref = _dense_reference(qq, k, v, old)
        torch.testing.assert_close(out[qsl[b]:qsl[b + 1]], ref, atol=1e-5, rtol=1e-5)


def test_write_kv_writes_the_mapped_slots_only() -> None:
    k_pool = torch.zeros(6, 4, 2, 8)
    v_pool = torch.zeros(6, 4, 2, 8)
    k = torch.randn(5, 2, 8)
    v = torch.randn(5, 2, 8)
    slots = torch.tensor([13, 14, 15, 2, 3])  # block 3 offsets 1..3, block 0 offsets 2..3
    write_kv(k, v, k_pool, v_pool, slots)
    flat_k, flat_v = k_pool.view(24, 2, 8), v_pool.view(24, 2, 8)
    torch.testing.assert_close(flat_k[slots], k, rtol=0, atol=0)
    torch.testing.assert_close(flat_v[slots], v, rtol=0, atol=0)
    others = torch.ones(24, dtype=torch.bool)
    others[slots] = False
    assert not flat_k[others].any() and not flat_v[others].any()


def test_batch_metadata() -> None:
    steps = [
        SeqStep(7, [1, 2, 3], 0, [5], is_prefill=True, logits="last"),
        SeqStep(9, [4], 6, [2, 0], is_prefill=False, logits="all"),
        SeqStep(3, [5, 6, 7, 8], 3, [1, 4], is_prefill=False, logits="all"),
    ]
    b = ForwardBatch.build(steps, block_size=4)
    assert b.seq_ids == [7, 9, 3]
    assert b.query_start_loc.tolist() == [0, 3, 4, 8]
    assert b.context_lens.tolist() == [3, 7, 7]
    assert b.positions.tolist() == [0, 1, 2, 6, 3, 4, 5, 6]
    assert b.slot_mapping.tolist() == [20, 21, 22, 2, 7, 16, 17, 18]
    assert b.block_tables.tolist() == [[5, 0], [2, 0], [1, 4]]
    assert b.logits_indices.tolist() == [2, 3, 4, 5, 6, 7]
    assert b.token_seq.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert b.token_qidx.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert (b.max_query_len, b.max_context_len) == (4, 7)




@pytest.mark.parametrize("seed", [7, 13])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 1)])
def test_static_kernel_matches_dense(seed: int, q_len: int, hq: int, hkv: int) -> None:
    """The CUDA backend's kernel for static half-precision batches (attention_cuda.py; on CPU through
    Triton's interpreter) over a padded-width static batch, the pool full of NaN garbage elsewhere:
    each row's tokens equal dense causal attention, and a wider static width gives the same bits.
    Seed 13 has a context of 79 + q tokens: two chunks of keys, combined by the last to arrive."""
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    from specialists.ops.attention import use_static_kernel
    from specialists.ops.attention_cuda import paged_attention_static

    steps, seqs, k_pool, v_pool = _case(seed, 16, hq, hkv, [q_len] * 3, float("nan"))
    batch = ForwardBatch.build(steps, 16)
    q = torch.cat([s[0] for s in seqs])
    write_kv(torch.cat([k[old:] for _, k, _, old in seqs]), torch.cat([v[old:] for _, _, v, old in seqs]),
             k_pool, v_pool, batch.slot_mapping)
    width = 64 * (1 + max(int(c) for c in batch.context_lens) // 64)
    batch.block_tables = torch.nn.functional.pad(batch.block_tables.long(), (0, width // 16 - batch.block_tables.shape[1]))
    batch.static, batch.max_context_len = True, width
    half = q.to(torch.bfloat16)
    assert use_static_kernel(half, batch) and not use_static_kernel(q, batch)
    out = paged_attention_static(half, k_pool.to(torch.bfloat16), v_pool.to(torch.bfloat16), batch).float()
    qsl = batch.query_start_loc.tolist()
    for b, (qq, k, v, old) in enumerate(seqs):
        ref = _dense_reference(qq.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), old)
        torch.testing.assert_close(out[qsl[b]:qsl[b + 1]], ref, atol=1e-2, rtol=1e-2)
    batch.max_context_len = 2 * width  # a wider static batch: the same keys, the same sums
    wide = paged_attention_static(half, k_pool.to(torch.bfloat16), v_pool.to(torch.bfloat16), batch).float()
    assert torch.equal(wide, out)


@pytest.mark.parametrize("old", [0, 5])
def test_a_fresh_prefill_attends_over_its_own_kv_as_over_the_pool(old: int) -> None:
    """A one-sequence prefill with nothing cached before it takes the step's own k and v (`fresh`)
    instead of gathering them back from the pool: the same bits. With a cached prefix (old > 0) the
    pool is read whatever `fresh` says: the result is attention over prefix and prompt together."""
    g = torch.Generator().manual_seed(7 + old)
    hq, hkv, D, T, bs = 6, 2, 16, 9, 4
    table = [7, 3, 11, 20]
    k_pool, v_pool = torch.full((24, bs, hkv, D), 1e30), torch.full((24, bs, hkv, D), 1e30)
    k, v = torch.randn(old + T, hkv, D, generator=g), torch.randn(old + T, hkv, D, generator=g)
    q = torch.randn(T, hq, D, generator=g)
    if old:
        write_kv(k[:old], v[:old], k_pool, v_pool, torch.from_numpy(flat_slots(table, 0, old, bs)))
    step = [SeqStep(0, list(range(T)), old, table, is_prefill=True, logits="all")]
    batch = ForwardBatch.build(step, bs)
    write_kv(k[old:], v[old:], k_pool, v_pool, batch.slot_mapping)
    gathered = paged_attention(q, k_pool, v_pool, batch)
    same = paged_attention(q, k_pool, v_pool, ForwardBatch.build(step, bs), fresh=(k[old:], v[old:]))
    assert torch.equal(gathered, same)
    torch.testing.assert_close(same, _dense_reference(q, k, v, old), atol=1e-5, rtol=1e-5)
    exact = ForwardBatch.build(step, bs)
    exact.row_exact = True  # a quantized engine's row-exact rows read the pool whatever fresh says
    assert torch.equal(paged_attention(q, k_pool, v_pool, exact, fresh=(k[old:] * 0, v[old:] * 0)),
                       paged_attention(q, k_pool, v_pool, exact))
