"""The prefix cache: committed FULL blocks, found by a chained hash of their token ids.

Each entry gets an id that is never reused. An entry records the id of its parent entry (the block
before it in the same prefix) and its own token ids; a hit requires the hash, the parent entry id and
the token ids to match, so a hash collision or a stale parent (evicted, its block reused) never hits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

ROOT_HASH = 0x9E3779B9  # the parent hash of a sequence's first block
ROOT_ENTRY = -1  # the parent entry id of a sequence's first block


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block's token ids. Only a lookup key: hits also compare token ids."""
    return hash((parent_hash, token_ids))


@dataclass(slots=True, frozen=True)
class CacheEntry:
    hash: int
    entry_id: int
    parent_entry_id: int
    block_id: int
    token_ids: tuple[int, ...]


@dataclass
class PrefixCache:
    _by_hash: dict[int, CacheEntry] = field(default_factory=dict)
    _by_block: dict[int, CacheEntry] = field(default_factory=dict)
    _next_entry_id: int = 0
    on_remove: Callable[[int], None] | None = None  # called with the entry id of every entry removed

    def __len__(self) -> int:
        return len(self._by_block)

    def entries(self) -> list[CacheEntry]:
        return list(self._by_block.values())

    def entry_of_block(self, block_id: int) -> CacheEntry | None:
        return self._by_block.get(block_id)

    def block_of(self, block_hash: int) -> int:
        """The block of the live entry of that hash (KeyError if none)."""
        return self._by_hash[block_hash].block_id

    def is_live(self, block_hash: int, entry_id: int) -> bool:
        """Whether entry `entry_id` (of that hash) is still in the cache."""
        e = self._by_hash.get(block_hash)
        return e is not None and e.entry_id == entry_id

    def lookup(self, block_hash: int, parent_entry_id: int, token_ids: tuple[int, ...]) -> CacheEntry | None:
        """The entry holding exactly these tokens after exactly that parent, or None."""
        e = self._by_hash.get(block_hash)
        if e is None or e.parent_entry_id != parent_entry_id or e.token_ids != token_ids:
            return None
        return e

    def insert(self, block_hash: int, parent_entry_id: int, token_ids: tuple[int, ...],
               block_id: int) -> CacheEntry | None:
        """Registers block_id. Returns the entry now standing for this content: an identical existing one
        (the block is then left uncached), the new one, or None on a hash collision with other content."""
        existing = self._by_hash.get(block_hash)
        if existing is not None:
            if existing.parent_entry_id == parent_entry_id and existing.token_ids == token_ids:
                return existing
            return None
        if block_id in self._by_block:
            raise AssertionError(f"block {block_id} is already cached as {self._by_block[block_id]}")
        e = CacheEntry(block_hash, self._next_entry_id, parent_entry_id, block_id, token_ids)
        self._next_entry_id += 1
        self._by_hash[block_hash] = e
        self._by_block[block_id] = e
        return e

    def remove_block(self, block_id: int) -> None:
        e = self._by_block.pop(block_id, None)
        if e is not None and self._by_hash.get(e.hash) is e:
            del self._by_hash[e.hash]
        if e is not None and self.on_remove is not None:
            self.on_remove(e.entry_id)
