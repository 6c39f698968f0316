"""Shared by the paged-KV tests (test_kv_cache.py, test_kv_cache_machine.py): a small cache whose K/V
values name the exact prefix that produced them, so a stale or foreign value shows."""

from __future__ import annotations

import torch

from state.kv_cache import KVCache, KVCacheConfig

BS, LAYERS, HEADS, DIM = 4, 2, 1, 2


def make_cache(num_blocks: int = 16, **kw: object) -> KVCache:
    return KVCache(KVCacheConfig(num_blocks=num_blocks, block_size=BS, num_layers=LAYERS, num_kv_heads=HEADS,
                                 head_dim=DIM, **kw))


def value_of(prefix: tuple[int, ...]) -> float:
    """The K value a token gets: a function of the whole prefix up to it, like real attention K/V."""
    return float(hash(prefix) % 9973 + 1)  # nonzero, exact in float32


def flat(t: torch.Tensor) -> torch.Tensor:  # [L, num_blocks, BS, H, D] -> [L, num_blocks * BS, H, D]
    return t.view(t.shape[0], -1, t.shape[3], t.shape[4])


def write(cache: KVCache, seq_id: int, start: int, values: list[float]) -> None:
    """Writes K = value + layer and V = -(value + layer) at positions start.. of the sequence."""
    slots = cache.slot_mapping(seq_id, start, len(values))
    vals = torch.tensor(values)[None, :] + torch.arange(LAYERS, dtype=torch.float32)[:, None]  # [L, n]
    flat(cache.k)[:, slots] = vals[:, :, None, None]
    flat(cache.v)[:, slots] = -vals[:, :, None, None]


def read_k(cache: KVCache, seq_id: int, start: int, n: int) -> torch.Tensor:  # [L, n, H, D]
    return flat(cache.k)[:, cache.slot_mapping(seq_id, start, n)]


def expected_k(tokens: list[int]) -> torch.Tensor:  # [L, n, H, D]
    vals = torch.tensor([value_of(tuple(tokens[:p + 1])) for p in range(len(tokens))])
    vals = vals[None, :] + torch.arange(LAYERS, dtype=torch.float32)[:, None]
    return vals[:, :, None, None].expand(LAYERS, len(tokens), HEADS, DIM)
