"""Verifying ahead: the next speculative verify launched before the host reads this one.

A greedy static verify (a CUDA graph) already accepts its rows on the device and drafts the next
step's chain there (spec/speculator.py, "drafting ahead"). What kept the device waiting was the host:
the next verify's positions, slots and context lengths depend on how many drafts this one kept, which
the host learned only at the step's sync, then it committed, emitted and built the next batch (~0.5-0.8
ms on an H100's host) while the device idled. Here the next verify is launched right behind this one's
chain: its batch is built by the host at the rows' committed ends (what it knows), then moved on the
device past the tokens this verify keeps (specialists/staging.advance_rows: kept count + 1, the target
token fed first, the chain's drafts after it), and its graph replays; its packed result is copied to
pinned memory behind it. The host then reads, cuts, commits and emits this step while the device runs
the next one.

The next engine step uses it (`settle`, then the speculator's verify) if it is the step the host would
build: the same sequences in the same order, each at the committed length the device assumed (every
run committed whole: no trigger, stop string or max_tokens cut it), every row greedy with the same K,
no grammar, the same context width, nobody admitted. Otherwise it is discarded before the scheduler
runs: the KV it wrote past each pointer is rolled back (its tail zeroed, blocks released) and the
drafter's outputs of the step before it, which its graph overwrote, are restored. Its KV (this step's
tokens, its own and its chain's entries: 3 (K+1) from the pointer) is reserved before the launch and
kept by this step's commit (`KVCache.commit(hold=True)`: the rejected drafts' positions are rewritten
by the step ahead, which starts at the first of them).

Attention-only models (a hybrid's verify commits its Mamba states on the host). Exact: the step ahead
is the graph the next step would replay over the inputs it would build (tests/test_verify_ahead.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from spec.decode_ahead import LaunchedAhead
from spec.grammar import active_guide
from state.block_pool import NoFreeBlocksError


@dataclass
class _Pending:
    seq_ids: list[int]
    k: int
    width: int  # its context width (a bucket)
    result: Any  # the runner's StepResult (its graph's static outputs)
    wait: Callable[[], list]  # its packed result's host copy
    draft_out: torch.Tensor  # the drafter's outputs of the step before (its graph may overwrite them)
    committed: list[int] | None = None  # each row's committed length it assumed (once the step before is read)


class VerifyAhead(LaunchedAhead):
    def launch(self, plan: Any, static: Any, drafts: torch.Tensor, draft_out: torch.Tensor, rebuild: Any) -> bool:
        """After a greedy static verify and its chain drafted ahead (`drafts` [Bp, k]): the next verify
        of the same rows, when the engine allows it and its KV can be reserved. -> launched."""
        rows, q = plan.rows, plan.k + 1
        if self.allowed is None or plan.limits is not None or not self.allowed(rows, q):  # limits: kept counts differ
            return False
        try:
            for r in rows:
                self.kv.reserve(r.seq_id, 3 * q)
        except NoFreeBlocksError:  # no room: the next step is built as usual (commit releases the rest)
            return False
        saved = draft_out.clone()  # queued before the step ahead's graph
        res = self.runner.run_ahead(rows, static.packed, drafts, rebuild)
        self._pending = _Pending([r.seq_id for r in rows], plan.k, res.batch.max_context_len, res,
                                 self.copies.start(res.static.packed[:len(rows)]), saved)
        self.launched += 1
        return True

    def assume(self, committed: list[int]) -> None:
        """The committed lengths the step ahead starts from, once the step before it is read."""
        if self._pending is not None:
            self._pending.committed = committed

    def settle(self, running: list) -> tuple[bool, torch.Tensor | None]:
        """Before the scheduler: keeps the step ahead if it is the step the host would build now, else
        discards it. -> (kept, the drafter outputs to restore after a discard)."""
        p = self._pending
        if p is None:
            return False, None
        if (p.committed is not None and [s.seq_id for s in running] == p.seq_ids
                and [self.kv.num_computed(s.seq_id) for s in running] == p.committed
                and all(s.spec_k == p.k and s.draft_ok and s.params.greedy and active_guide(s) is None for s in running)
                and self.runner.static_shape(len(running), max(p.committed) + p.k + 1)[1] == p.width):
            return True, None
        self.discard()
        return False, p.draft_out

    def take(self, plan: Any) -> tuple[Any, Callable[[], list]] | None:
        """The step ahead for this plan (settled: it matches), with the wait for its host copy; None
        when there is none."""
        p, self._pending = self._pending, None
        if p is None:
            return None
        st = plan.static
        if (st is None or plan.k != p.k or st.width != p.width or st.committed != p.committed
                or [r.seq_id for r in plan.rows] != p.seq_ids):
            raise RuntimeError("the verify launched ahead does not match the step scheduled (Engine.step settles it first)")
        self.used += 1
        return p.result, p.wait
