"""The drafter's lazy catch-up: entries owed for tokens committed while it did not run.

A plain step under the `auto` gate's fallback skips the drafter's rebuild, so that it costs what a
plain step costs; the drafter then has no entries for those tokens, and drafts after the gate
resumes would attend over stale ones (a re-probe judged on such drafts finds speculation slower than
it is). Instead each such step's target hidden states and tokens are kept (eager steps only: a CPU's;
multi-step graphs keep no per-token hidden states), and the next step that rebuilds writes the owed
entries first, oldest first, in one drafter call over the spans: the cost is paid once, on resume,
not on every fallback step. At most CAP tokens are owed per sequence (the most recent: a long
fallback leaves its oldest tokens stale, the ones the next drafts read the least).

A plain step costs the catch-up one record in a log (the step's tensors whole and its sequence ids):
no tensor work and no bookkeeping per row. Who owes which tokens is worked out on resume, by walking
the log back from each sequence's committed end: between two rebuilds every step a sequence runs in is
logged, so its owed tokens are contiguous and end there. (A per-row ledger cost 13 us a step, 1-4% of
a CPU batch-8 step of the toys, measured 2026-11-27; the log ~1 us.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

CAP = 512
LOG_TOKENS = 16  # the log keeps at most CAP steps and CAP x LOG_TOKENS tokens (prefills are large)


class _Step:
    """One plain step: its sequence ids in batch order, every row's span where a row fed more than one
    token (a prefill: seq_id -> (start, first row, rows)), its hidden states [T, d] and the token after
    each (or the step's sampled tokens, when every row is a one-token decode: row b is token b)."""

    __slots__ = ("no", "ids", "spans", "hidden", "tokens")

    def __init__(self, no: int, ids: tuple[int, ...], spans: dict[int, tuple[int, int, int]] | None,
                 hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        self.no, self.ids, self.spans, self.hidden, self.tokens = no, ids, spans, hidden, tokens

    def span(self, sid: int, end: int) -> tuple[int, int, int]:
        """(start, first row, rows) of sid in this step, given where its owed tokens end."""
        if self.spans is not None:
            return self.spans[sid]
        return end - 1, self.ids.index(sid), 1


class CatchUp:
    def __init__(self) -> None:
        self._log: deque[_Step] = deque()
        self._log_tokens = 0
        self._no = 0  # steps logged so far
        self._since: dict[int, int] = {}  # seq_id -> the first logged step it owes tokens of

    @property
    def owes(self) -> bool:
        """Whether any sequence owes tokens."""
        return bool(self._since)

    def forget(self, seq_id: int) -> None:
        self._since.pop(seq_id, None)
        self._drop_idle_log()

    def _drop_idle_log(self) -> None:
        if not self._since:  # nothing owed: the log's tensors go
            self._log.clear()
            self._log_tokens = 0

    def stash(self, rows: Sequence[Any], entries: set[int], owe_new: bool, hidden: torch.Tensor,
              tokens: torch.Tensor, next_tokens: Callable[[], torch.Tensor], computed: Callable[[int], int]) -> None:
        """A step that skipped the rebuild (rows: spec.step.Row in batch order). A row's tokens become
        owed when its sequence has drafter entries (in `entries`) or owes already, and under the gate's
        fallback (owe_new) when it is a prompt. tokens: the step's sampled tokens, which are the tokens
        after each fed one when every row is a one-token decode; else next_tokens() gives them."""
        ids = tuple(r.seq.seq_id for r in rows)
        since, no = self._since, self._no
        spans = None
        if any(r.prefill or r.k for r in rows):
            spans = {r.seq.seq_id: (computed(r.seq.seq_id) if r.prefill else r.seq.num_tokens - 1, r.t0, r.q) for r in rows}
            tokens = next_tokens()
            for r in rows:
                if r.prefill and owe_new and r.seq.seq_id not in since:
                    since[r.seq.seq_id] = no
        owing = False
        for sid in ids:
            if sid in since:
                owing = True
            elif sid in entries:
                since[sid] = no
                owing = True
        if not owing:
            return
        self._log.append(_Step(no, ids, spans, hidden, tokens))
        self._no += 1
        self._log_tokens += hidden.shape[0]
        while len(self._log) > 1 and (len(self._log) > CAP or self._log_tokens > CAP * LOG_TOKENS):
            self._log_tokens -= self._log.popleft().hidden.shape[0]

    def _owed(self, sid: int, end: int) -> list[tuple[int, int, _Step, int]]:
        """sid's owed chunks (start, rows, step, first row), oldest first: the log walked back from end
        (its committed length) through the steps since it began owing, the most recent CAP or so."""
        first = self._since.get(sid)
        if first is None:
            return []
        chunks: list[tuple[int, int, _Step, int]] = []
        count = 0
        for step in reversed(self._log):
            if step.no < first or count >= CAP:
                break
            if sid not in step.ids:
                continue
            start, lo, n = step.span(sid, end)
            if start < 0 or start + n != end:  # not contiguous (a preempted sequence's recompute): stop there
                break
            chunks.append((start, n, step, lo))
            count += n
            end = start
        chunks.reverse()
        return chunks

    def owed(self, seq_id: int, computed: Callable[[int], int]) -> int:
        """How many tokens the catch-up would write for seq_id now (computed: committed lengths)."""
        return sum(n for _, n, _, _ in self._owed(seq_id, computed(seq_id))) if seq_id in self._since else 0

    def run(self, runner: Any, drafter: Any, seq_ids: list[int], computed: Callable[[int], int]) -> int:
        """Writes the entries owed for these sequences (before their step's own rebuild) -> how many."""
        spans, hidden, toks = [], [], []
        for sid in seq_ids:
            if sid not in self._since:
                continue
            chunks = self._owed(sid, computed(sid))
            del self._since[sid]
            if not chunks:
                continue
            spans.append((sid, chunks[0][0], sum(n for _, n, _, _ in chunks)))
            hidden.extend(step.hidden[lo:lo + n] for _, n, step, lo in chunks)
            toks.extend(step.tokens.reshape(-1)[lo:lo + n] for _, n, step, lo in chunks)
        self._drop_idle_log()
        if not spans:
            return 0
        drafter.rebuild(runner.history_batch(spans), torch.cat(hidden), torch.cat(toks))
        return sum(n for _, _, n in spans)
