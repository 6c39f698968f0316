"""Which prefix-cache blocks hold the drafter's entries too.

The drafter's paged KV lives in the target's blocks (specialists/drafter.py). A block computed by plain
steps (mode off, or the auto gate's fallback without a catch-up) holds no drafter entries, and a
prefix hit on it used to speculate over them: output exact, acceptance after such a hit down from
0.56 to 0.32 (build) and 0.49 to 0.39 (cpp; bench/RESULTS.md, 2026-11-27). So a sequence whose every
step wrote the drafter's entries (and whose own prefix hit was on marked blocks) marks its full
blocks' cache entries when it finishes; where an entry stands on another block with the same tokens
(computed earlier, plainly), the drafter's entries are copied there. While the engine speculates, a
hit is cut back to marked entries (the rest is computed again, drafter included), as a hybrid's hit
is cut back to blocks with a Mamba state; while it decodes plainly, a hit takes every cached block.
Marks are prefix-closed: a marked sequence's chain includes its hit, itself marked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class DraftMarks:
    def __init__(self, kv: Any, copy_block: Callable[[int, int], None]) -> None:
        self.kv = kv
        self.copy_block = copy_block  # (source block, destination block): the drafter's entries
        self._marked: set[int] = set()  # prefix-cache entry ids (never reused)
        self.copied = 0  # blocks whose drafter entries were copied to the entry's own block

    def usable(self, entry_id: int) -> bool:
        """Whether a speculating engine's hit may end at that entry."""
        return entry_id in self._marked

    def hit_marked(self, seq_id: int, cached: int) -> bool:
        """Whether the sequence's hit of `cached` tokens lies on marked entries only."""
        return all(self.kv.entry_id(seq_id, i) in self._marked for i in range(cached // self.kv.block_size))

    def mark(self, seq_id: int) -> None:
        """A finishing sequence whose drafter entries cover its tokens: its full blocks' entries, in order."""
        table = self.kv.block_table(seq_id)
        for i in range(self.kv.num_computed(seq_id) // self.kv.block_size):
            entry, block = self.kv.cached_block(seq_id, i)
            if entry is None:  # not in the cache (evicted, a collision): nothing after it either
                break
            if entry not in self._marked and block != table[i]:
                self.copy_block(table[i], block)
                self.copied += 1
            self._marked.add(entry)
        if len(self._marked) > 4 * self.kv.cfg.num_blocks:  # evicted entries' ids: drop them now and then
            self._marked &= self.kv.live_entry_ids()
