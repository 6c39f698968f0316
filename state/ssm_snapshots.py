"""Mamba state snapshots for a hybrid model's prefix cache: the conv and SSM state of every Mamba layer
after a committed block boundary, kept with the prefix-cache entry of the block that ends there.

A KV prefix hit alone is not enough for a hybrid: the Mamba layers carry the whole prefix in a
fixed-size state, so a hit of n tokens must also bring the state after exactly those n tokens. Here:

* capture: every committed position on the snapshot grid (every `stride` tokens, a multiple of the
  block size: default_stride) gets a snapshot of the sequence's state there. Only
  committed tokens count: a prefill's block boundaries come from the prefill itself
  (`SSMCache.want_prefill_states` -> mamba2_prefill_at), a decode's or verify's from the step's staged
  per-token states, at most up to the kept length (`SSMCache.state_after(n <= kept)`), never from a
  draft position past it; the slot itself only where it already holds the state after all the step
  commits. `plan` (before the forward) and `capture` (after acceptance, before the commit) run in the
  engine's step; `store` after the KV commit has entered the blocks into the prefix cache.
* keep: a bounded pool of snapshots keyed by prefix-cache entry id (an entry stands for a whole
  prefix, chained by parent entry and compared by token ids, so a snapshot is the state after exactly
  that prefix). An entry owns its snapshot: when the entry leaves the prefix cache (its block is
  evicted or cut) the snapshot is dropped with it (`PrefixCache.on_remove`). When the pool is full, the
  least recently used snapshot is evicted; its entry keeps its KV but can no longer end a hit.
* hit: `has` is KVCache.add_sequence's `usable`, which cuts a hit back to the longest prefix that has
  both KV and a snapshot; `restore` copies that snapshot into the new sequence's slot.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from state.kv_cache import KVCache
from state.ssm_cache import SSMCache, SSMCacheConfig

__all__ = ["DEFAULT_SNAPSHOT_BYTES", "PendingSnapshot", "SSMSnapshots", "snapshot_bytes", "default_capacity",
           "default_stride", "pool_shape"]

log = logging.getLogger(__name__)

DEFAULT_SNAPSHOT_BYTES = 256 << 20  # the pool's default size: as many snapshots as fit in 256 MiB
# the default grid keeps at most this many bytes of snapshot a token: about a large attention model's KV
# a token (llama-3b: 112 KiB), so that a long prefill's snapshots cannot crowd out the KV they go with
SNAPSHOT_BYTES_PER_TOKEN = 128 << 10


def snapshot_bytes(c: SSMCacheConfig) -> int:
    """Bytes of one snapshot: every Mamba layer's conv state and fp32 SSM state."""
    conv = c.conv_dim * (c.d_conv - 1) * torch.empty(0, dtype=c.conv_dtype).element_size()
    return c.num_layers * (conv + c.num_heads * c.head_dim * c.d_state * 4)


def default_capacity(c: SSMCacheConfig, num_blocks: int, blocks_per_snapshot: int = 1) -> int:
    """Snapshots in the default pool: DEFAULT_SNAPSHOT_BYTES worth, at most one per grid step of the KV
    blocks, at least one."""
    return max(1, min(num_blocks // blocks_per_snapshot, DEFAULT_SNAPSHOT_BYTES // snapshot_bytes(c)))


def default_stride(c: SSMCacheConfig, block_size: int) -> int:
    """Tokens between two snapshots: the smallest power-of-two number of blocks whose tokens carry at most
    SNAPSHOT_BYTES_PER_TOKEN of snapshot each. The toys' ~0.4 MiB snapshots: every block (16 tokens);
    bamba-1b's 24.3 MiB: every 256 tokens. A grid of every block would hold a 2,000-token prefill's 125
    states at once at bamba-1b (3 GB) and flush a pool of 10 with one prompt."""
    blocks = 1
    while snapshot_bytes(c) > SNAPSHOT_BYTES_PER_TOKEN * blocks * block_size:
        blocks *= 2
    return blocks * block_size


def pool_shape(c: SSMCacheConfig, num_blocks: int, block_size: int, capacity: int | None,
               stride: int | None) -> tuple[int, int]:
    """(snapshots in the pool, tokens between two): the asked ones, else the defaults (capacity 0: no pool)."""
    stride = stride or default_stride(c, block_size)
    return (capacity if capacity is not None else default_capacity(c, num_blocks, stride // block_size)), stride


@dataclass(slots=True)
class PendingSnapshot:
    """A committed boundary's state, captured before the commit, stored once its entry exists."""

    seq_id: int
    position: int  # the state is after this many tokens (a multiple of the block size)
    conv: torch.Tensor  # [L, conv_dim, K-1]
    ssm: torch.Tensor  # [L, H, P, N] fp32


class SSMSnapshots:
    def __init__(self, ssm: SSMCache, kv: KVCache, capacity: int, stride: int | None = None) -> None:
        """stride: tokens between two snapshots, a multiple of the block size (None: the block size)."""
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        c = ssm.config
        self.cache, self.kv, self.capacity = ssm, kv, capacity
        self.block_size = kv.block_size
        self.stride = stride or kv.block_size
        if self.stride % self.block_size:
            raise ValueError(f"stride {self.stride} is not a multiple of the block size {self.block_size}")
        self.conv = torch.zeros(capacity, c.num_layers, c.conv_dim, c.d_conv - 1, dtype=c.conv_dtype, device=c.device)
        self.ssm = torch.zeros(capacity, c.num_layers, c.num_heads, c.head_dim, c.d_state, dtype=torch.float32,
                               device=c.device)
        self._index: OrderedDict[int, int] = OrderedDict()  # entry id -> pool index; least recently used first
        self._free = list(range(capacity - 1, -1, -1))
        self.saved = self.restored = self.evicted = self.dropped = 0
        kv.prefix.on_remove = self.drop

    def __len__(self) -> int:
        return len(self._index)

    def has(self, entry_id: int) -> bool:
        return entry_id in self._index

    # ---- the step's hooks ----------------------------------------------------------------------

    def _boundaries(self, start: int, n: int) -> list[int]:
        """Token counts j in [1, n] after which start + j is on the snapshot grid."""
        g = self.stride
        first = (start // g + 1) * g
        return [p - start for p in range(first, start + n + 1, g)]

    def plan(self, prefills: list[tuple[Any, list[int]]]) -> None:
        """Before the forward: each prefill (sequence, its new tokens) keeps its states at the grid's
        positions strictly inside it (its end is the slot's state after the forward)."""
        for seq, tokens in prefills:
            start = self.kv.num_computed(seq.seq_id)
            self.cache.want_prefill_states(seq.ssm_slot, self._boundaries(start, len(tokens) - 1))

    def capture(self, rows: list[Any], kept: list[int]) -> list[PendingSnapshot]:
        """After acceptance, before the commit: the states at the block boundaries each row commits
        (rows: spec.step.Row; kept: the run tokens kept, as the speculator's commit reads them)."""
        out: list[PendingSnapshot] = []
        try:
            for row, m in zip(rows, kept):
                m = len(row.tokens) if row.prefill else max(m, 1)  # what the commit keeps of the fed tokens
                start = self.kv.num_computed(row.seq_id)
                for j in self._boundaries(start, m):
                    conv, ssm = self.cache.state_after(row.ssm_slot, j, last=j == m)
                    out.append(PendingSnapshot(row.seq_id, start + j, conv, ssm))
        finally:
            self.cache.release_held()
        return out

    def store(self, pending: list[PendingSnapshot]) -> None:
        """After the KV commit: each captured state goes to the entry of the block ending at it."""
        for p in pending:
            entry = self.kv.entry_id(p.seq_id, p.position // self.block_size - 1)
            if entry is None:  # the block did not enter the cache (a hash collision)
                continue
            if entry in self._index:  # the same prefix, snapshotted already
                self._index.move_to_end(entry)
                continue
            self._save(entry, p.conv, p.ssm)

    def restore(self, seq_id: int, slot: int, cached: int) -> None:
        """A prefix hit of `cached` tokens (a multiple of the block size, > 0): its snapshot into `slot`."""
        entry = self.kv.entry_id(seq_id, cached // self.block_size - 1)
        idx = self._index.get(entry) if entry is not None else None
        if idx is None:
            raise AssertionError(f"seq {seq_id}: a prefix hit of {cached} tokens has no Mamba state snapshot")
        self._index.move_to_end(entry)
        self.cache.conv[slot] = self.conv[idx]
        self.cache.ssm[slot] = self.ssm[idx]
        self.restored += 1

    # ---- the pool ------------------------------------------------------------------------------

    def _save(self, entry: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        if self._free:
            idx = self._free.pop()
        else:
            old, idx = self._index.popitem(last=False)
            self.evicted += 1
            log.debug("snapshot of entry %d evicted (pool of %d full)", old, self.capacity)
        self.conv[idx] = conv
        self.ssm[idx] = ssm
        self._index[entry] = idx
        self.saved += 1

    def drop(self, entry_id: int) -> None:
        """The entry left the prefix cache: its snapshot goes with it."""
        idx = self._index.pop(entry_id, None)
        if idx is not None:
            self._free.append(idx)
            self.dropped += 1

    def stats(self) -> dict[str, int]:
        return {"ssm_snapshots": len(self._index), "ssm_snapshot_capacity": self.capacity, "ssm_snapshot_stride": self.stride,
                "ssm_snapshots_saved": self.saved, "ssm_snapshots_restored": self.restored,
                "ssm_snapshots_evicted": self.evicted, "prefix_hit_tokens_without_state": self.kv.unusable_hit_tokens}

    def check_invariants(self) -> None:
        """Every snapshot belongs to a live prefix-cache entry; pool indices are used once or free."""
        live = {e.entry_id for e in self.kv.prefix.entries()}
        stale = sorted(set(self._index) - live)
        if stale:
            raise AssertionError(f"snapshots of entries no longer in the prefix cache: {stale}")
        used = list(self._index.values())
        if len(set(used)) != len(used) or set(used) & set(self._free) or len(used) + len(self._free) != self.capacity:
            raise AssertionError(f"snapshot pool corrupt: used {sorted(used)}, free {sorted(self._free)}")
