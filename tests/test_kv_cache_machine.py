"""Paged KV cache, property test: random add / reserve / write / commit / rollback / free sequences
(hypothesis state machine) against a model of each sequence's committed ids; after every step the
cache's invariants hold, no block leaks, and every committed position holds its own prefix's K/V."""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kv_helpers import BS, expected_k, flat, make_cache, read_k, value_of, write

from state.kv_cache import NoFreeBlocksError

NUM_BLOCKS = 6
BASES = [(0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2), (0, 1, 2, 0, 2, 2, 1, 1, 0, 0, 1, 2), (1, 1, 1, 1, 0, 0, 0, 0, 2, 2)]
based = st.builds(lambda base, cut, tail: list(base[:cut]) + tail, st.sampled_from(BASES), st.integers(1, 12),
                  st.lists(st.integers(0, 2), max_size=4))
prompts = st.one_of(based, based, st.lists(st.integers(0, 2), min_size=1, max_size=10))  # prefixes collide often


class KVCacheMachine(RuleBasedStateMachine):
    """Random add/reserve/write/commit/rollback/free; a model holds each sequence's committed ids."""

    @initialize(data=st.data(), warm=st.sampled_from(BASES), keep=st.booleans())
    def setup(self, data: st.DataObject, warm: tuple[int, ...], keep: bool) -> None:
        """Starts with one prompt computed (and freed unless keep): its full blocks are in the prefix cache."""
        self.cache = make_cache(num_blocks=NUM_BLOCKS)
        self.next_id = 0
        self.tokens: dict[int, list[int]] = {}  # committed ids
        self.prompt: dict[int, list[int]] = {}
        self.reserved: dict[int, int] = {}  # reserved end
        self.written: dict[int, list[int]] = {}  # ids written past the pointer, not yet committed
        self.add(list(warm[:9]))
        sid = self.next_id - 1
        assert self._reserve(sid, 9)
        self._write(data, sid)
        self._commit(data, sid, acc=9)
        if not keep:
            self.free(data)

    def _snapshot(self) -> tuple:
        c = self.cache
        return ({s: (c.block_table(s), c.num_computed(s)) for s in self.tokens}, c.num_free_blocks(),
                list(c.pool.refcounts), len(c.prefix))

    @precondition(lambda self: len(self.tokens) < 4)
    @rule(prompt=prompts)
    def add(self, prompt: list[int]) -> None:
        sid, self.next_id = self.next_id, self.next_id + 1
        hit = self.cache.add_sequence(sid, prompt)
        assert hit % BS == 0 and hit <= (len(prompt) - 1) // BS * BS
        assert self.cache.num_computed(sid) == hit
        self.tokens[sid], self.prompt[sid] = prompt[:hit], prompt
        self.reserved[sid], self.written[sid] = hit, []

    def _pick(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.tokens)))

    def _reserve(self, sid: int, n: int) -> bool:
        before = self._snapshot()
        try:
            self.cache.reserve(sid, n)
        except NoFreeBlocksError:
            assert self._snapshot() == before, "a failed reserve changed the state"
            return False
        self.reserved[sid] = max(self.reserved[sid], len(self.tokens[sid]) + n)
        assert len(self.cache.block_table(sid)) * BS >= self.reserved[sid]
        return True

    def _write(self, data: st.DataObject, sid: int) -> None:
        """Fills every reserved position: prompt ids where the prompt has them, random drafts beyond."""
        toks, prompt = self.tokens[sid], self.prompt[sid]
        start, n = len(toks), self.reserved[sid] - len(toks)
        ids = [prompt[p] if p < len(prompt) else data.draw(st.integers(0, 2)) for p in range(start, start + n)]
        write(self.cache, sid, start, [value_of(tuple(toks + ids[:i + 1])) for i in range(n)])
        self.written[sid] = ids

    def _commit(self, data: st.DataObject, sid: int, acc: int | None = None) -> None:
        ids = self.written[sid]
        if acc is None:
            acc = data.draw(st.one_of(st.just(0), st.just(len(ids)), st.integers(0, len(ids))))
        self.cache.commit(sid, ids, acc)
        self.tokens[sid] += ids[:acc]
        self.reserved[sid], self.written[sid] = len(self.tokens[sid]), []

    @precondition(lambda self: 0 < len(self.tokens) < 4)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def add_follow_up(self, data: st.DataObject, tail: list[int]) -> None:
        """A new request that extends a live one's committed tokens (a next turn): a prefix hit."""
        self.add(self.tokens[self._pick(data)] + tail)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(0, 6))
    def reserve(self, data: st.DataObject, n: int) -> None:
        self._reserve(self._pick(data), n)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        self._write(data, self._pick(data))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        self._commit(data, self._pick(data))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), chunk=st.integers(1, 8), k=st.integers(0, 3))
    def engine_step(self, data: st.DataObject, chunk: int, k: int) -> None:
        """What the engine does in one step: a prompt chunk (all kept) or a verify of k drafts + 1."""
        sid = self._pick(data)
        remaining = len(self.prompt[sid]) - len(self.tokens[sid])
        n = min(chunk, remaining) if remaining > 0 else k + 1
        if self.written[sid] or not self._reserve(sid, n):
            return
        self._write(data, sid)
        self._commit(data, sid, acc=len(self.written[sid]) if remaining > 0 else None)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        to = data.draw(st.integers(0, len(self.tokens[sid])))
        before = self._snapshot()
        try:
            self.cache.rollback(sid, to)
        except NoFreeBlocksError:
            assert self._snapshot() == before
            return
        del self.tokens[sid][to:]
        self.reserved[sid], self.written[sid] = to, []

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.free(sid)
        for d in (self.tokens, self.prompt, self.reserved, self.written):
            del d[sid]

    @invariant()
    def consistent(self) -> None:
        c = self.cache
        c.check_invariants()
        refs = Counter(b for s in self.tokens for b in c.block_table(s))
        assert all(c.pool.refcounts[b] == refs.get(b, 0) for b in range(NUM_BLOCKS)), "leaked or double-freed block"
        assert c.num_free_blocks() + len(refs) == NUM_BLOCKS
        for sid, toks in self.tokens.items():
            assert c.num_computed(sid) == len(toks)
            # every committed position holds the K/V of exactly its own prefix: nothing stale, no drafts
            assert torch.equal(read_k(c, sid, 0, len(toks)), expected_k(toks)), f"seq {sid} sees foreign K/V"
            assert torch.equal(flat(c.v)[:, c.slot_mapping(sid, 0, len(toks))], -expected_k(toks))

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for sid in list(self.tokens):
            self.cache.free(sid)
        self.cache.check_invariants()
        assert self.cache.num_free_blocks() == NUM_BLOCKS


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
TestKVCacheMachine = KVCacheMachine.TestCase
