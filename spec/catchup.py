"""The drafter's lazy catch-up: entries owed for tokens committed while it did not run.

A plain step under the `auto` gate's fallback skips the drafter's rebuild, so that it costs what a
plain step costs; the drafter then has no entries for those tokens, and drafts after the gate
resumes would attend over stale ones (a re-probe judged on such drafts finds speculation slower than
it is). Instead the step's target hidden states and next tokens are kept per sequence (eager steps
only: a CPU's; multi-step graphs keep no per-token hidden states), and the next step that rebuilds
writes the owed entries first, oldest first, in one drafter call over the spans: the cost is paid
once, on resume, not on every fallback step. At most CAP tokens are owed per sequence (the most
recent: a long fallback leaves its oldest tokens stale, the ones the next drafts read the least).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

CAP = 512


class _Owed:
    """One sequence's owed tokens: contiguous chunks (start, n, the step's hidden [T, d], its next
    tokens [T], the sequence's first row in them), oldest first. A chunk holds the step's tensors
    whole and is cut on catch-up only: stashing is a few list operations, no tensor work per step."""

    __slots__ = ("chunks", "count")

    def __init__(self) -> None:
        self.chunks: deque[tuple[int, int, torch.Tensor, torch.Tensor, int]] = deque()
        self.count = 0

    def end(self) -> int | None:
        return self.chunks[-1][0] + self.chunks[-1][1] if self.chunks else None


class CatchUp:
    def __init__(self) -> None:
        self._owed: dict[int, _Owed] = {}

    def owed(self, seq_id: int) -> int:
        o = self._owed.get(seq_id)
        return o.count if o is not None else 0

    def forget(self, seq_id: int) -> None:
        self._owed.pop(seq_id, None)

    def stash(self, spans: list[tuple[int, int, int, int]], hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """A step that skipped the rebuild: spans (seq_id, first position, first row, rows) of the
        sequences whose tokens are now owed. hidden [T, d], next_tokens [T]: the step's (eager, so
        tensors of their own that no later step overwrites), per token."""
        for sid, start, lo, n in spans:
            o = self._owed.get(sid)
            if o is None:
                o = self._owed[sid] = _Owed()
            elif o.chunks and o.end() != start:  # not contiguous (cannot happen while the sequence lives)
                o.chunks.clear()
                o.count = 0
            o.chunks.append((start, n, hidden, next_tokens, lo))
            o.count += n
            while o.count - o.chunks[0][1] >= CAP:  # keep the most recent CAP or so
                o.count -= o.chunks.popleft()[1]

    def run(self, runner: Any, drafter: Any, seq_ids: list[int]) -> int:
        """Writes the entries owed for these sequences (before their step's own rebuild) -> how many."""
        spans, hidden, toks = [], [], []
        for sid in seq_ids:
            o = self._owed.pop(sid, None)
            if o is None or not o.chunks:
                continue
            spans.append((sid, o.chunks[0][0], o.count))
            hidden.extend(h[lo:lo + n] for _, n, h, _, lo in o.chunks)
            toks.extend(t[lo:lo + n] for _, n, _, t, lo in o.chunks)
        if not spans:
            return 0
        drafter.rebuild(runner.history_batch(spans), torch.cat(hidden), torch.cat(toks))
        return sum(n for _, _, n in spans)
