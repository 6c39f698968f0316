"""The drafter's static chain under a grammar: a CUDA graph per depth, the host between them.

Draft j of each row is the argmax of the drafter's logits under the bitmask of its grammar state after
drafts 0..j-1 (specialists/ops/grammar_mask.masked_argmax, over the draft vocabulary, as full-vocabulary
ids). The host fills that bitmask (spec/grammar.DraftMasks) after reading draft j-1, so a depth costs
one graph replay (the fused drafter's kernels, ~8), one copy of the mask in and one read of the depth's
drafts out, masked and unmasked (the second only for the stat of drafts the mask changed). (Not
reading the last depth saves a sync but leaves no mask for the token after it, so a row that keeps
every draft must drop that token: measured on an H100, acceptance fell from 0.39-0.46 to 0.32-0.35 on
the toys and the constrained speed-up did not improve; not kept.) The eager
torch chain it replaces cost ~30 launches per depth. Each depth's graph reads and writes only this
chain's static buffers, the staged contexts and tables, and the drafter's pool at the chained entry's
own index (C + depth - 2, reserved by the verify and overwritten by its rebuild), as FusedDrafter.chain.
A depth whose draft the host knows already, because every guided row's mask there allows exactly one
token of the draft vocabulary (a key name, a quote, a colon: the masked argmax can only be that token),
is not read: the host feeds that token to the matchers and fills the next depth's masks while the
device runs the depth, and the next read takes every depth since the last one in one copy. The free
picks of depths after the last read (only the mask-changed count needs them) are copied to the host
behind the chain and counted after the step's sync (spec/grammar.Guide.late). On an H100 (cpp, 30
schemas) 25% of guided depths were forced so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specialists.ops.grammar_mask import masked_argmax


SKIP_FORCED = True  # False: read every depth (the tests compare both ways)


@dataclass
class GuidedBuffers:
    prev: torch.Tensor  # [k, Bp, d] each depth's entry output
    pair: torch.Tensor  # [k, 2, Bp] int64 per depth: the masked drafts, then the drafter's own picks (full ids)
    words: torch.Tensor  # [Bp, W] int32 the depth's bitmasks, on the device
    host: torch.Tensor  # [k, Bp, W] int32 each depth's on the host (pinned on a GPU); padding rows allow all
    late: torch.Tensor  # [k, 2, Bp] int64 host (pinned on a GPU): the unread depths, copied behind the chain
    host_np: np.ndarray  # host's numpy view, and host per depth (views made once: torch indexing costs µs)
    host_rows: list[torch.Tensor]

    @property
    def drafts(self) -> torch.Tensor:  # [k, Bp]
        return self.pair[:, 0]

    @property
    def free(self) -> torch.Tensor:  # [k, Bp]
        return self.pair[:, 1]


def _buffers(drafter: Any, num_rows: int, k: int, words: int) -> GuidedBuffers:
    cache = drafter.__dict__.setdefault("_guided", {})
    key = (num_rows, k, words)
    if key not in cache:
        dev, d = drafter.k.device, drafter.cfg.hidden_size
        pin = dev.type == "cuda"
        host = torch.full((k, num_rows, words), -1, dtype=torch.int32, pin_memory=pin)
        cache[key] = GuidedBuffers(torch.zeros(k, num_rows, d, dtype=drafter.k.dtype, device=dev),
                                   torch.zeros(k, 2, num_rows, dtype=torch.int64, device=dev), host[0].to(dev), host,
                                   torch.zeros(k, 2, num_rows, dtype=torch.int64, pin_memory=pin), host.numpy(), list(host))
    return cache[key]


def _vocab_allowed(drafter: Any, vocab_size: int) -> np.ndarray | None:
    """[V] bool on the host: the draft vocabulary's ids (None: the drafter drafts over the full vocabulary)."""
    if drafter.vocab is None:
        return None
    cached = drafter.__dict__.get("_vocab_allowed")
    if cached is None or cached.shape[0] != vocab_size:
        cached = np.zeros(vocab_size, dtype=bool)
        cached[drafter.vocab.cpu().numpy()] = True
        drafter.__dict__["_vocab_allowed"] = cached
    return cached


def _depth(f: Any, buf: GuidedBuffers, j: int, c: torch.Tensor, idx: torch.Tensor, tables: torch.Tensor,
           k: int, width: int) -> None:
    """Depth j of the chain (in a graph): entry output, then the masked greedy draft."""
    ops = f.ops
    if j == 0:
        prev = f.entries.index_select(0, idx)
    else:
        x = ops.rows_linear(buf.prev[j - 1], f.w.hidden, norm_eps=f.eps, tokens=buf.drafts[j - 1], table=f.w.token_proj)
        q = f._qkv(x, committed=c, tables=tables, entry_add=j - 1)
        o = ops.paged_attention(q, f.k, f.v, tables, c, j, f.scale, 1, width + k)
        prev = f._layer(x, o)
    buf.prev[j].copy_(prev)
    logits = ops.rows_linear(prev, f.w.head, norm_eps=f.eps)
    masked_argmax(logits, buf.words, f.vocab, buf.pair[j, 0], buf.pair[j, 1])


def _run_depth(drafter: Any, buf: GuidedBuffers, j: int, key: tuple[int, int, int], c: torch.Tensor,
               idx: torch.Tensor, tables: torch.Tensor) -> None:
    num_rows, k, width = key
    drafter.graphs.run(("guided", j) + key, lambda: _depth(drafter.fused, buf, j, c, idx, tables, k, width))


def capture_guided_chain(drafter: Any, key: tuple[int, int, int], c: torch.Tensor, idx: torch.Tensor,
                         tables: torch.Tensor, words: int) -> int:
    """Every depth's graph for key (at warm-up, on staged padding rows) -> how many were captured."""
    buf = _buffers(drafter, key[0], key[1], words)
    before = len(drafter.graphs)
    for j in range(key[1]):
        _run_depth(drafter, buf, j, key, c, idx, tables)
    return len(drafter.graphs) - before


def guided_chain(drafter: Any, key: tuple[int, int, int], c: torch.Tensor, idx: torch.Tensor, tables: torch.Tensor,
                 S: int, guide: Any) -> tuple[torch.Tensor, list[int]]:
    """key (Bp, k, width); c, idx, tables: the staged static inputs (PagedDrafter._stage); S real rows;
    guide: spec.grammar.DraftMasks over those rows -> drafts [Bp, k] and the drafts each row may verify."""
    num_rows, k, _ = key
    buf = _buffers(drafter, num_rows, k, guide.words)
    allowed = _vocab_allowed(drafter, guide.masks.vocab_size)
    last, read = None, 0  # the host's draft j-1 of each row; depths read so far
    for j in range(k):
        host = buf.host_np[j, :S]  # a depth's own host words: an unread depth's copy may still be queued
        guide.depth_words(j, last, host)
        buf.words.copy_(buf.host_rows[j], non_blocking=True)
        _run_depth(drafter, buf, j, key, c, idx, tables)
        last = guide.forced(j, host, allowed) if SKIP_FORCED else None
        if last is not None:  # every guided row's draft j is the one token its mask allows
            continue
        for chosen, free in buf.pair[read:j + 1].tolist():  # depths read..j in one copy: the wait
            guide.note_host(chosen[:S], free[:S])
        read = j + 1
        last = chosen[:S]
    drafter.__dict__["guided_unread"] = drafter.__dict__.get("guided_unread", 0) + k - read
    if read < k:  # the free picks of the unread depths come with the step's sync (the mask-changed count)
        late = buf.late[:k - read]
        late.copy_(buf.pair[read:k], non_blocking=True)
        guide.note_late(late)
    guide.finish_host(last, k)
    return buf.drafts.t(), guide.counts  # a view: the verify copies it into its inputs
