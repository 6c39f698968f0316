"""Paged KV cache: block tables per sequence over a shared block pool, a prefix cache of committed
full blocks, and the commit/rollback of speculative steps with tail zeroing (lessons 6, 7, 10).

Per sequence, the write pointer `num_computed` is the number of leading tokens whose K/V are in the
cache; it always equals the length of the committed token list. The engine reserves room past the
pointer, writes K/V there through `slot_mapping`, then `commit`s how many of the written tokens are
kept; the rest is rolled back and the partial tail of the last kept block is zeroed, so no later
reader (this sequence or one that hits its blocks in the prefix cache) can see rejected drafts.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from state import prefix_cache as _pc
from state.block_pool import BlockPool, NoFreeBlocksError
from state.prefix_cache import PrefixCache
from state.transfer import device_ints

__all__ = ["KVCache", "KVCacheConfig", "NoFreeBlocksError", "SlotRangeError", "UnknownSequenceError", "flat_slots"]

logger = logging.getLogger(__name__)


class UnknownSequenceError(KeyError):
    """The sequence id was never added, or was already freed."""


class SlotRangeError(IndexError):
    """Slots were asked for positions outside [0, reserved end) of a sequence."""


def flat_slots(table: Sequence[int] | np.ndarray, start: int, end: int, block_size: int) -> np.ndarray:
    """-> [end - start] int64: the flat KV slot (block id * block_size + offset) of each position
    start..end-1 under the block table `table` (block ids by block index; it must cover `end`)."""
    p = np.arange(start, end)
    return np.asarray(table, dtype=np.int64)[p // block_size] * block_size + p % block_size


@dataclass
class KVCacheConfig:
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    enable_prefix_cache: bool = True


@dataclass(slots=True)
class _Seq:
    prompt: list[int]
    tokens: list[int]  # committed token ids; len == num_computed
    num_computed: int  # KV write pointer
    table: list[int]  # block ids covering positions [0, len(table) * block_size)
    reserved_end: int  # positions [num_computed, reserved_end) may hold uncommitted K/V
    chain: list[tuple[int, int]] = field(default_factory=list)  # (hash, entry id) of leading full blocks known to the cache


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


class KVCache:
    def __init__(self, cfg: KVCacheConfig) -> None:
        if cfg.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {cfg.block_size}")
        self.cfg = cfg
        self.block_size = cfg.block_size
        # one block past the pool: scratch, never handed out, where padding rows of a bucketed batch
        # write (specialists/runner.py); nothing reads it back
        self.scratch_block = cfg.num_blocks
        shape = (cfg.num_layers, cfg.num_blocks + 1, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k: torch.Tensor = torch.zeros(shape, dtype=cfg.dtype, device=cfg.device)  # [L, num_blocks, block_size, H_kv, D]
        self.v: torch.Tensor = torch.zeros(shape, dtype=cfg.dtype, device=cfg.device)  # [L, num_blocks, block_size, H_kv, D]
        self.pool = BlockPool(cfg.num_blocks)
        self.prefix = PrefixCache()
        self._seqs: dict[int, _Seq] = {}
        self.unusable_hit_tokens = 0  # cached tokens a hit left out: no usable entry at their end (add_sequence)

    # ---- queries -------------------------------------------------------------------------------

    def num_free_blocks(self) -> int:
        """Free blocks plus cached blocks that nobody references (evictable)."""
        return self.pool.num_free()

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of num_tokens fits without any prefix-cache hit."""
        return _cdiv(max(num_tokens, 0), self.block_size) <= self.pool.num_free()

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).table)

    def num_computed(self, seq_id: int) -> int:
        return self._seq(seq_id).num_computed

    def sequence_ids(self) -> list[int]:
        return list(self._seqs)

    def entry_id(self, seq_id: int, block_index: int) -> int | None:
        """The live prefix-cache entry standing for the sequence's committed full block `block_index`
        (None: not in the cache, e.g. after a hash collision, or an identical entry since evicted)."""
        chain = self._seq(seq_id).chain
        if not 0 <= block_index < len(chain):
            return None
        h, entry = chain[block_index]
        return entry if self.prefix.is_live(h, entry) else None

    def cached_block(self, seq_id: int, block_index: int) -> tuple[int | None, int]:
        """(live entry id, the block that entry stands on) for the sequence's committed full block
        `block_index`: another block than the sequence's own where identical content was cached first.
        (None, -1) when not in the cache."""
        entry = self.entry_id(seq_id, block_index)
        if entry is None:
            return None, -1
        return entry, self.prefix.block_of(self._seq(seq_id).chain[block_index][0])

    def live_entry_ids(self) -> set[int]:
        return {e.entry_id for e in self.prefix.entries()}

    def slot_mapping(self, seq_id: int, start: int, n: int) -> list[int]:
        """Flat slots (block_id * block_size + offset) of positions start..start+n-1, all reserved."""
        s = self._seq(seq_id)
        if start < 0 or n < 0 or start + n > s.reserved_end:
            raise SlotRangeError(f"seq {seq_id}: positions [{start}, {start + n}) outside reserved [0, {s.reserved_end})")
        return flat_slots(s.table, start, start + n, self.block_size).tolist()

    # ---- lifecycle -----------------------------------------------------------------------------

    def add_sequence(self, seq_id: int, token_ids: list[int], usable: Callable[[int], bool] | None = None) -> int:
        """Registers the prompt, shares the prefix-cache hits over its full blocks (never the block of
        the last prompt token) and returns the number of cached tokens, now the write pointer.
        `usable(entry_id)`: whether a hit may end at that entry (a hybrid's: it has the Mamba state
        there); the hit is cut back to the longest prefix that ends at a usable entry."""
        if seq_id in self._seqs:
            raise ValueError(f"seq {seq_id} already exists")
        bs = self.block_size
        table: list[int] = []
        chain: list[tuple[int, int]] = []
        if self.cfg.enable_prefix_cache:
            hits, found = self._prefix_hits(token_ids, usable)
            self.unusable_hit_tokens += (found - len(hits)) * bs
            for h, e in hits:
                self.pool.incref(e.block_id)
                table.append(e.block_id)
                chain.append((h, e.entry_id))
        n = len(table) * bs
        self._seqs[seq_id] = _Seq(list(token_ids), list(token_ids[:n]), n, table, n, chain)
        if n:
            logger.debug("seq %d: prefix hit of %d tokens (%d blocks)", seq_id, n, len(table))
        return n

    def cached_prefix(self, token_ids: list[int], usable: Callable[[int], bool] | None = None) -> int:
        """The tokens add_sequence would find cached for this prompt; nothing is registered."""
        return len(self._prefix_hits(token_ids, usable)[0]) * self.block_size if self.cfg.enable_prefix_cache else 0

    def _prefix_hits(self, token_ids: list[int], usable: Callable[[int], bool] | None) -> tuple[list, int]:
        """(block hash, entry) of each cached full block the prompt starts with, cut back to the longest run
        that ends at a usable entry; and how many blocks matched before the cut."""
        hits: list[tuple[int, _pc.CacheEntry]] = []
        parent_hash, parent_entry, bs = _pc.ROOT_HASH, _pc.ROOT_ENTRY, self.block_size
        for i in range((len(token_ids) - 1) // bs):  # empty prompt: range(-1) is empty
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            h = _pc.hash_block(parent_hash, toks)
            e = self.prefix.lookup(h, parent_entry, toks)
            if e is None:
                break
            hits.append((h, e))
            parent_hash, parent_entry = h, e.entry_id
        found = len(hits)
        while usable is not None and hits and not usable(hits[-1][1].entry_id):
            hits.pop()
        return hits, found

    def reserve(self, seq_id: int, num_new_tokens: int) -> None:
        """Makes the table cover [0, num_computed + num_new_tokens); all or nothing."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        s = self._seq(seq_id)
        end = s.num_computed + num_new_tokens
        need = _cdiv(end, self.block_size) - len(s.table)
        if need > 0:
            s.table.extend(self._allocate(need))  # raises NoFreeBlocksError before any change
        s.reserved_end = max(s.reserved_end, end)

    def commit(self, seq_id: int, written_token_ids: list[int], num_accepted: int, hold: bool = False) -> None:
        """K/V were written for written_token_ids at [num_computed, num_computed + len); keeps the first
        num_accepted, rolls back the rest and enters newly full committed blocks into the prefix cache.
        hold: nothing is rolled back here, the reservation past the pointer stays (a step launched ahead
        writes there: spec/decode_ahead.py, spec/verify_ahead.py; a verify ahead rewrites the rejected
        drafts' positions); if that step is discarded, its discard rolls back."""
        s = self._seq(seq_id)
        n = len(written_token_ids)
        if not 0 <= num_accepted <= n:
            raise ValueError(f"seq {seq_id}: num_accepted={num_accepted} not in [0, {n}]")
        if s.num_computed + n > s.reserved_end:
            raise ValueError(f"seq {seq_id}: wrote {n} tokens at {s.num_computed} past reserved end {s.reserved_end}")
        accepted = list(written_token_ids[:num_accepted])
        p0 = s.num_computed
        in_prompt = max(0, min(len(s.prompt), p0 + num_accepted) - p0)
        if accepted[:in_prompt] != s.prompt[p0:p0 + in_prompt]:
            raise ValueError(f"seq {seq_id}: committed ids at [{p0}, {p0 + in_prompt}) differ from the prompt")
        s.tokens.extend(accepted)
        s.num_computed += num_accepted
        if not hold:
            # nothing rejected: the tail past the pointer was not written this step (and was zero before)
            self.rollback(seq_id, s.num_computed, zero_tail=num_accepted < n)
        if self.cfg.enable_prefix_cache:
            self._register_full_blocks(s)

    def rollback(self, seq_id: int, num_tokens: int, zero_tail: bool = True) -> None:
        """Moves the pointer (and the committed list) back to num_tokens: trailing blocks are released,
        the partial tail of the last kept block is zeroed in every layer of k and v (zero_tail=False: the
        caller knows nothing past num_tokens was written since the tail was last zero; saves two kernels). A kept partial block
        shared with another table is copied first (copy-on-write); raises NoFreeBlocksError, changing
        nothing, if that copy has no block."""
        s = self._seq(seq_id)
        if not 0 <= num_tokens <= s.num_computed:
            raise ValueError(f"seq {seq_id}: cannot roll back to {num_tokens} (pointer {s.num_computed})")
        bs = self.block_size
        keep = _cdiv(num_tokens, bs)
        off = num_tokens % bs  # 0: the kept blocks end exactly at the pointer, no tail
        last = s.table[keep - 1] if off else -1  # never index -1 into the table (lesson 10)
        cow = off != 0 and self.pool.refcounts[last] > 1
        if cow:
            released = sum(1 for b in s.table[keep:] if self.pool.refcounts[b] == 1)
            if self.pool.num_free() + released < 1:
                raise NoFreeBlocksError(f"seq {seq_id}: no block to copy shared block {last} on rollback")
        for b in reversed(s.table[keep:]):
            self.pool.decref(b)
        del s.table[keep:]
        del s.tokens[num_tokens:]
        del s.chain[num_tokens // bs:]
        s.num_computed = num_tokens
        s.reserved_end = num_tokens
        if off:
            if cow:
                (new,) = self._allocate(1)  # zero-filled
                self.k[:, new, :off] = self.k[:, last, :off]
                self.v[:, new, :off] = self.v[:, last, :off]
                self.pool.decref(last)
                s.table[-1] = new
            else:
                if self.pool.cached[last]:  # a committed full block cut short: its entry is no longer true
                    self.prefix.remove_block(last)
                    self.pool.unmark_cached(last)
                if zero_tail:
                    self.k[:, last, off:] = 0
                    self.v[:, last, off:] = 0
        _require(s.num_computed == len(s.tokens),
                 f"seq {seq_id}: pointer {s.num_computed} != committed length {len(s.tokens)}")
        _require(len(s.table) == _cdiv(num_tokens, bs),
                 f"seq {seq_id}: table has {len(s.table)} blocks, want ceil({num_tokens}/{bs})")

    def free(self, seq_id: int) -> None:
        """Releases every block; cached full blocks stay in the prefix cache, evictable (LRU)."""
        s = self._seqs.pop(seq_id, None)
        if s is None:
            raise UnknownSequenceError(seq_id)
        for b in reversed(s.table):  # tail first: deeper blocks are evicted before the prefix heads
            self.pool.decref(b)

    # ---- invariants ----------------------------------------------------------------------------

    def check_invariants(self, seq_id: int | None = None) -> None:
        """Raises AssertionError naming the first broken invariant; checks the pool, the prefix cache and
        one sequence (or all of them)."""
        self._check_pool()
        seqs = self._seqs.items() if seq_id is None else [(seq_id, self._seq(seq_id))]
        for sid, s in seqs:
            self._check_seq(sid, s)

    def _check_pool(self) -> None:
        pool, nb = self.pool, self.cfg.num_blocks
        counts = Counter(b for s in self._seqs.values() for b in s.table)
        free, evictable = pool.free_ids(), pool.evictable_ids()
        free_set, ev_set = set(free), set(evictable)
        _require(len(free_set) == len(free), f"free list has duplicates (double free): {sorted(free)}")
        _require(not (free_set & ev_set), f"blocks both free and evictable: {sorted(free_set & ev_set)}")
        used = 0
        for b in range(nb):
            rc = pool.refcounts[b]
            _require(rc == counts.get(b, 0), f"block {b}: refcount {rc} but {counts.get(b, 0)} table references")
            in_cache = self.prefix.entry_of_block(b) is not None
            _require(pool.cached[b] == in_cache, f"block {b}: pool cached flag {pool.cached[b]} but in cache {in_cache}")
            if rc > 0:
                used += 1
                _require(b not in free_set and b not in ev_set, f"block {b} is referenced (refcount {rc}) and free")
            elif pool.cached[b]:
                _require(b in ev_set, f"block {b}: unreferenced cached block not evictable")
            else:
                _require(b in free_set, f"block {b}: unreferenced uncached block leaked (not in the free list)")
        _require(len(free) + len(evictable) + used == nb,
                 f"free {len(free)} + evictable {len(evictable)} + used {used} != num_blocks {nb}")

    def _check_seq(self, sid: int, s: _Seq) -> None:
        bs = self.block_size
        _require(s.num_computed == len(s.tokens),
                 f"seq {sid}: write pointer {s.num_computed} != committed length {len(s.tokens)}")
        _require(s.reserved_end >= s.num_computed, f"seq {sid}: reserved end {s.reserved_end} < pointer {s.num_computed}")
        _require(len(s.table) >= _cdiv(s.reserved_end, bs),
                 f"seq {sid}: table of {len(s.table)} blocks does not cover reserved end {s.reserved_end}")
        if s.reserved_end == s.num_computed:
            _require(len(s.table) == _cdiv(s.num_computed, bs),
                     f"seq {sid}: table has {len(s.table)} blocks, want ceil({s.num_computed}/{bs}) with nothing reserved")
        n_prompt = min(len(s.prompt), s.num_computed)
        _require(s.tokens[:n_prompt] == s.prompt[:n_prompt], f"seq {sid}: committed tokens differ from the prompt")
        _require(len(s.chain) <= s.num_computed // bs, f"seq {sid}: {len(s.chain)} chained blocks past the pointer")
        for i, b in enumerate(s.table):
            e = self.prefix.entry_of_block(b)
            if e is None:
                continue
            _require(i < s.num_computed // bs, f"seq {sid}: block {b} at index {i} is cached but not full and committed")
            _require(list(e.token_ids) == s.tokens[i * bs:(i + 1) * bs],
                     f"seq {sid}: cached block {b} holds tokens {e.token_ids}, sequence has {s.tokens[i * bs:(i + 1) * bs]}")
        start = s.reserved_end
        tail_blocks = s.table[start // bs:]
        if tail_blocks:
            idx = torch.tensor(tail_blocks, device=self.k.device)
            for name, t in (("k", self.k), ("v", self.v)):
                tail = t.index_select(1, idx).flatten(1, 2)[:, start % bs:]  # [L, positions past the end, H, D]
                _require(not bool(tail.any()),
                         f"seq {sid}: {name} is nonzero past position {start} (stale tail in blocks {tail_blocks})")

    # ---- internals -----------------------------------------------------------------------------

    def _seq(self, seq_id: int) -> _Seq:
        s = self._seqs.get(seq_id)
        if s is None:
            raise UnknownSequenceError(seq_id)
        return s

    def _allocate(self, n: int) -> list[int]:
        """n zero-filled blocks; evicted cached blocks lose their prefix-cache entries."""
        a = self.pool.allocate(n)
        for b in a.evicted:
            self.prefix.remove_block(b)
        idx = device_ints(a.block_ids, self.k.device)  # no sync: a pageable copy would wait for the step
        self.k.index_fill_(1, idx, 0)
        self.v.index_fill_(1, idx, 0)
        return a.block_ids

    def _register_full_blocks(self, s: _Seq) -> None:
        """Enters the sequence's newly full committed blocks into the prefix cache, in chain order."""
        bs = self.block_size
        parent_hash, parent_entry = s.chain[-1] if s.chain else (_pc.ROOT_HASH, _pc.ROOT_ENTRY)
        for i in range(len(s.chain), s.num_computed // bs):
            toks = tuple(s.tokens[i * bs:(i + 1) * bs])
            h = _pc.hash_block(parent_hash, toks)
            b = s.table[i]
            e = self.prefix.insert(h, parent_entry, toks, b)
            if e is None:  # hash collision with other content: this sequence caches no further
                break
            if e.block_id == b:
                self.pool.mark_cached(b)
            s.chain.append((h, e.entry_id))
            parent_hash, parent_entry = h, e.entry_id
