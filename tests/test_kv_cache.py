"""Paged KV cache: block accounting, prefix hits (ids compared, not just hashes), rollback with tail
zeroing, all-rejected steps (lesson 10) and drafts never leaking across requests (lesson 7). The
random-operations property test is in test_kv_cache_machine.py."""

from __future__ import annotations

import pytest
import torch
from kv_helpers import BS, DIM, HEADS, LAYERS, expected_k, flat, make_cache, read_k, value_of, write

from state import prefix_cache
from state.kv_cache import KVCache, NoFreeBlocksError, SlotRangeError

DRAFT_MARK = 777.0  # K/V value of draft tokens in the deterministic tests


def prefill(cache: KVCache, seq_id: int, prompt: list[int]) -> int:
    """Adds the sequence and computes its whole prompt in one chunk; returns the prefix hit."""
    hit = cache.add_sequence(seq_id, prompt)
    n = len(prompt) - hit
    cache.reserve(seq_id, n)
    write(cache, seq_id, hit, [value_of(tuple(prompt[:p + 1])) for p in range(hit, len(prompt))])
    cache.commit(seq_id, prompt[hit:], n)
    cache.check_invariants()
    return hit


def speculate(cache: KVCache, seq_id: int, tokens: list[int], drafts: list[int], num_accepted: int,
              draft_values: bool = False) -> None:
    """One verify step: reserve len(drafts), write them (as real values or DRAFT_MARK), commit."""
    nc = cache.num_computed(seq_id)
    cache.reserve(seq_id, len(drafts))
    if draft_values:
        vals = [DRAFT_MARK] * len(drafts)
    else:
        vals = [value_of(tuple(tokens + drafts[:i + 1])) for i in range(len(drafts))]
    write(cache, seq_id, nc, vals)
    cache.commit(seq_id, drafts, num_accepted)
    cache.check_invariants()


# ---- prefix cache ------------------------------------------------------------------------------


def test_prefix_hit_shares_full_blocks() -> None:
    cache = make_cache()
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert prefill(cache, 0, a) == 0
    b = a[:8] + [11, 12, 13]
    assert cache.add_sequence(1, b) == 2 * BS
    assert cache.num_computed(1) == 2 * BS
    assert cache.block_table(1) == cache.block_table(0)[:2]
    for blk in cache.block_table(1):
        assert cache.pool.refcounts[blk] == 2
    cache.check_invariants()
    torch.testing.assert_close(read_k(cache, 1, 0, 8), expected_k(b[:8]))
    # the block holding the last prompt token is never reused: an 8-token prompt hits one block only
    assert cache.add_sequence(2, a[:8]) == BS
    assert cache.add_sequence(3, a[:4] + [99, 6, 7, 8, 9]) == BS  # second block differs
    cache.check_invariants()
    for sid in range(4):
        cache.free(sid)
    assert cache.num_free_blocks() == 16
    cache.check_invariants()


def test_hash_collision_does_not_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_cache, "hash_block", lambda parent, toks: 42)
    cache = make_cache()
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    prefill(cache, 0, a)
    assert cache.add_sequence(1, [9, 9, 9, 9, 8, 8, 8, 8, 7]) == 0  # same hash, other ids: no hit
    assert cache.block_table(1) == []
    # identical ids still hit the first block; the second collided on insert and was never cached
    assert cache.add_sequence(2, a) == BS
    assert cache.block_table(2) == cache.block_table(0)[:1]
    cache.check_invariants()
    # same ids after a different parent: the parent entry is compared too
    b2 = [1, 2, 3, 4, 1, 2, 3, 4, 9]
    a2 = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    cache2 = make_cache()
    prefill(cache2, 0, a2)
    assert cache2.add_sequence(1, b2) == BS
    assert cache2.block_table(1) == cache2.block_table(0)[:1]
    cache2.check_invariants()


def test_prefix_cache_disabled_and_eviction() -> None:
    off = make_cache(enable_prefix_cache=False)
    prefill(off, 0, list(range(9)))
    assert off.add_sequence(1, list(range(9))) == 0
    assert len(off.prefix) == 0

    cache = make_cache(num_blocks=4)
    prefill(cache, 0, list(range(9)))  # 3 blocks, 2 full ones cached
    cache.free(0)
    assert cache.num_free_blocks() == 4 and len(cache.prefix) == 2
    assert cache.can_allocate(16) and not cache.can_allocate(17)
    prefill(cache, 1, [50 + i for i in range(13)])  # needs all 4 blocks: both cached ones are evicted
    assert len(cache.prefix) == 3  # its own 3 full blocks
    cache.free(1)
    assert cache.add_sequence(2, list(range(9))) == 0  # evicted: no stale hit
    cache.check_invariants()


# ---- rollback ----------------------------------------------------------------------------------


def test_rollback_zeroes_exactly_the_tail() -> None:
    cache = make_cache()
    prefill(cache, 0, list(range(1, 12)))  # 11 tokens: blocks 0, 1 full, block 2 has 3
    table = cache.block_table(0)
    assert len(table) == 3
    k0, v0 = cache.k.clone(), cache.v.clone()
    free0 = cache.num_free_blocks()
    cache.rollback(0, 6)  # mid block 1
    assert cache.num_computed(0) == 6
    assert cache.block_table(0) == table[:2]
    assert cache.num_free_blocks() == free0 + 1  # block 2 went back
    b = table[1]
    for t, t0 in ((cache.k, k0), (cache.v, v0)):
        assert torch.count_nonzero(t[:, b, 2:]) == 0  # past the pointer: zero in every layer
        assert torch.equal(t[:, b, :2], t0[:, b, :2])  # before: unchanged
        assert torch.count_nonzero(t[:, b, :2]) == LAYERS * 2 * HEADS * DIM
        assert torch.equal(t[:, table[0]], t0[:, table[0]])
    cache.check_invariants()
    cache.rollback(0, 4)  # block boundary: nothing to zero, block 1 released
    assert cache.block_table(0) == table[:1]
    cache.rollback(0, 0)
    assert cache.block_table(0) == [] and cache.num_computed(0) == 0
    cache.check_invariants()
    with pytest.raises(ValueError):
        cache.rollback(0, 1)  # never forward


def test_rollback_into_shared_block_copies_it() -> None:
    cache = make_cache()
    a = list(range(1, 10))
    prefill(cache, 0, a)
    assert cache.add_sequence(1, a) == 2 * BS
    shared = cache.block_table(1)[1]
    before = cache.k[:, shared].clone()
    cache.rollback(1, 6)  # inside a block that sequence 0 also uses
    assert cache.block_table(1)[1] != shared
    assert torch.equal(cache.k[:, shared], before)  # the other reader's block is untouched
    torch.testing.assert_close(read_k(cache, 1, 0, 6), expected_k(a[:6]))
    cache.check_invariants()


def test_all_rejected_and_all_accepted_steps() -> None:
    cache = make_cache()
    # pointer 0, everything rejected: nothing kept, no block kept, no -1 index
    cache.add_sequence(0, [5, 6, 7])
    cache.reserve(0, 3)
    write(cache, 0, 0, [DRAFT_MARK] * 3)
    cache.commit(0, [5, 6, 7], 0)
    assert cache.num_computed(0) == 0 and cache.block_table(0) == []
    cache.check_invariants()

    tokens = list(range(1, 9))  # pointer at a block boundary
    prefill(cache, 1, tokens)
    free0 = cache.num_free_blocks()
    speculate(cache, 1, tokens, [20, 21, 22, 23], 0, draft_values=True)
    assert cache.num_computed(1) == 8 and len(cache.block_table(1)) == 2
    assert cache.num_free_blocks() == free0
    speculate(cache, 1, tokens, [20, 21, 22, 23], 4)  # all accepted
    tokens += [20, 21, 22, 23]
    assert cache.num_computed(1) == 12 and len(cache.block_table(1)) == 3
    speculate(cache, 1, tokens, [30, 31, 32, 33], 1)
    tokens += [30]
    speculate(cache, 1, tokens, [40, 41, 42, 43], 0, draft_values=True)  # mid block, all rejected
    assert cache.num_computed(1) == 13
    torch.testing.assert_close(read_k(cache, 1, 0, 13), expected_k(tokens))
    with pytest.raises(ValueError):
        cache.commit(1, [1], 2)
    with pytest.raises(ValueError):
        cache.commit(1, [1, 2], 1)  # never reserved
    with pytest.raises(SlotRangeError):
        cache.slot_mapping(1, 12, 2)


def test_no_free_blocks_leaves_state_unchanged() -> None:
    cache = make_cache(num_blocks=3)
    prefill(cache, 0, list(range(1, 7)))  # 2 blocks
    table, nc, free = cache.block_table(0), cache.num_computed(0), cache.num_free_blocks()
    assert not cache.can_allocate(2 * BS)
    with pytest.raises(NoFreeBlocksError):
        cache.reserve(0, 3 * BS - 6 + 1)  # 13 positions: 4 blocks
    assert (cache.block_table(0), cache.num_computed(0), cache.num_free_blocks()) == (table, nc, free)
    with pytest.raises(SlotRangeError):
        cache.slot_mapping(0, nc, 1)  # the failed reserve reserved nothing
    cache.check_invariants()
    cache.reserve(0, 3 * BS - 6)  # 12 positions: exactly fits
    assert cache.num_free_blocks() == 0


# ---- lesson 7 ----------------------------------------------------------------------------------


def test_drafts_never_leak_through_prefix_hits() -> None:
    """A writes drafts past its pointer and rolls back; B hits A's committed blocks while A still has
    drafts pending, and again after A is gone. B sees exactly what an isolated run of B sees."""
    cache = make_cache(num_blocks=5)  # tight: C below must reuse the block A wrote drafts into
    a = list(range(1, 11))  # 10 tokens: pointer mid block 2
    prefill(cache, 0, a)
    cache.reserve(0, 4)  # verify [t, d1, d2, d3] at positions 10..13: blocks 2 and 3
    write(cache, 0, 10, [value_of(tuple(a + [50]))] + [DRAFT_MARK] * 3)
    cache.commit(0, [50, 51, 52, 53], 1)  # drafts rejected, their tail in block 2 and block 3 dropped
    cache.check_invariants()
    a.append(50)
    speculate(cache, 0, a, [60, 61, 62, 63], 1)
    a.append(60)  # 12 tokens: block 2 full and cached
    assert len(cache.prefix) == 3
    cache.reserve(0, 4)
    write(cache, 0, 12, [DRAFT_MARK] * 4)  # A's drafts pending in block 3 while B arrives

    b = a + [70, 71]
    assert cache.add_sequence(1, b) == 12
    assert cache.block_table(1) == cache.block_table(0)[:3]
    prefill_rest = [value_of(tuple(b[:p + 1])) for p in range(12, 14)]
    cache.reserve(1, 2)
    assert cache.block_table(1)[3] != cache.block_table(0)[3]
    write(cache, 1, 12, prefill_rest)
    cache.commit(1, b[12:], 2)
    draft_block = cache.block_table(0)[3]
    cache.commit(0, [80, 81, 82, 83], 0)  # A rejects everything
    cache.check_invariants()
    cache.free(0)

    c = a[:12] + [70, 71, 72]
    assert cache.add_sequence(2, c) == 12  # after A is gone; A's block 3 is back in the pool
    cache.reserve(2, 3)
    assert cache.block_table(2)[3] == draft_block
    assert not bool((flat(cache.k)[:, cache.slot_mapping(2, 12, 3)] != 0).any())  # fresh room is zero
    write(cache, 2, 12, [value_of(tuple(c[:p + 1])) for p in range(12, 15)])
    cache.commit(2, c[12:], 3)
    cache.check_invariants()

    for sid, toks in ((1, b), (2, c)):
        iso = make_cache(num_blocks=8)
        prefill(iso, 0, toks)
        shared_view = read_k(cache, sid, 0, len(toks))
        assert torch.equal(shared_view, read_k(iso, 0, 0, len(toks)))
        assert not bool((shared_view == DRAFT_MARK).any())
        # no block of the sequence holds a draft anywhere, past its pointer included
        assert not bool((cache.k[:, cache.block_table(sid)] == DRAFT_MARK).any())
