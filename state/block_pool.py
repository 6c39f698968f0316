"""The block pool: reference counts, the free list, and the LRU list of evictable cached blocks.

A block is in exactly one of three places:
- referenced (refcount > 0) by one or more block tables;
- free: refcount 0 and not in the prefix cache, reusable at once;
- evictable: refcount 0 but still in the prefix cache; reused (least recently released first) only
  when no free block is left, and its cache entry must then be dropped by the caller.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for (even after evicting every cached block)."""


@dataclass(slots=True)
class Allocation:
    """Blocks handed out by BlockPool.allocate, and which of them were evicted from the prefix cache."""

    block_ids: list[int]
    evicted: list[int]


@dataclass
class BlockPool:
    num_blocks: int
    refcounts: list[int] = field(init=False)
    cached: list[bool] = field(init=False)  # the block holds a prefix-cache entry
    _free: deque[int] = field(init=False)
    _evictable: OrderedDict[int, None] = field(init=False)  # refcount 0 and cached; LRU first

    def __post_init__(self) -> None:
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        self.refcounts = [0] * self.num_blocks
        self.cached = [False] * self.num_blocks
        self._free = deque(range(self.num_blocks))
        self._evictable = OrderedDict()

    def num_free(self) -> int:
        """Blocks that can be handed out now: free plus evictable cached blocks."""
        return len(self._free) + len(self._evictable)

    def free_ids(self) -> list[int]:
        return list(self._free)

    def evictable_ids(self) -> list[int]:
        return list(self._evictable)

    def allocate(self, n: int) -> Allocation:
        """Hands out n blocks with refcount 1: free ones first, then the least recently released cached ones."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free():
            raise NoFreeBlocksError(f"need {n} blocks, only {self.num_free()} free or evictable")
        ids: list[int] = []
        evicted: list[int] = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                self.cached[b] = False
                evicted.append(b)
            self.refcounts[b] = 1
            ids.append(b)
        if evicted:
            logger.debug("evicted cached blocks %s", evicted)
        return Allocation(ids, evicted)

    def incref(self, block_id: int) -> None:
        """Another table references this block (a prefix-cache hit); revives it if it was evictable."""
        if self.refcounts[block_id] == 0:
            if block_id not in self._evictable:
                raise AssertionError(f"block {block_id} has refcount 0 but is not cached; cannot share it")
            del self._evictable[block_id]
        self.refcounts[block_id] += 1

    def decref(self, block_id: int) -> None:
        """One table drops this block; at refcount 0 it becomes free, or evictable when cached."""
        rc = self.refcounts[block_id]
        if rc <= 0:
            raise AssertionError(f"double free of block {block_id} (refcount {rc})")
        self.refcounts[block_id] = rc - 1
        if rc == 1:
            if self.cached[block_id]:
                self._evictable[block_id] = None  # most recently released: evicted last
            else:
                self._free.append(block_id)

    def mark_cached(self, block_id: int) -> None:
        self.cached[block_id] = True

    def unmark_cached(self, block_id: int) -> None:
        """The block's cache entry was dropped: an unreferenced block moves from evictable to free."""
        if not self.cached[block_id]:
            return
        self.cached[block_id] = False
        if block_id in self._evictable:
            del self._evictable[block_id]
            self._free.append(block_id)
