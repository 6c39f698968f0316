"""Decoding ahead: the next plain multi-step decode launched before the host reads this one.

At real sizes on a GPU a plain step (specialists/multistep.py: S greedy tokens per row in one graph)
is a replay of a few ms followed by ~0.5-0.8 ms of host work (the copy of its tokens, the cut at
triggers, commit, emit, the next step's batch) while the device idles: 15% of a Llama-3.2-1B step
on an H100. When the next step is predictable (the same sequences decode greedily, each keeping
every token of this one, nobody waiting to be admitted, speculation off) it is launched right
behind this one, before this step's host copy: its inputs are staged S positions further, each
row's first token is read on the device from this step's output, and its packed output is copied
to pinned host memory behind it. The host then works while the device runs the step ahead.

The next engine step consumes it (`settle`, then the speculator's forward): the rows of the
sequences still running (a finished one's row is dropped) at the committed length assumed. Any
other change (a run cut short by a trigger, a policy switch, the room near max_model_len) discards
it before the scheduler runs: the KV it wrote past each sequence's pointer is rolled back, its tail
zeroed and blocks released, as a rejected draft's. Its KV is reserved before the launch and kept by
the commit of the step before (`KVCache.commit(hold=True)`). A finished sequence's blocks are freed
while the step ahead may still write them, which is safe in stream order: whoever gets them next
writes after it. A hybrid's multi-step Mamba states are staged and committed by the host after the
step: before the step ahead launches, the state after every token of this step is written into the
slots on the device (`SSMCache.write_staged_last`: the step ahead starts from it), and this step's
commit then writes the state after the tokens it keeps (the same one, or an earlier one for a run cut
short, whose step ahead is discarded). The runner replays two copies of a hybrid's multi-step graph
in turn, so this step's staged states are not overwritten by the step ahead before that commit; the
step ahead's own are staged when the next step uses it.

Exact: the step ahead is the graph the next step would replay over the inputs it would build, so the
tokens are the plain engine's (tests/test_decode_ahead.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from spec.acceptance import unpack
from spec.step import StepOutput
from state.block_pool import NoFreeBlocksError
from state.transfer import device_ints


class HostCopies:
    """Copies of small device tensors to pinned host memory, two in flight at most (one step's and
    the step ahead's)."""

    def __init__(self) -> None:
        self._slots: list[tuple[torch.Tensor, Any] | None] = [None, None]
        self._next = 0

    def start(self, t: torch.Tensor) -> Callable[[], list]:
        """Queues t's copy to the host; -> a call that waits for it and returns t.tolist()."""
        if not t.is_cuda:
            return t.clone().tolist
        i, self._next = self._next, self._next ^ 1
        n, slot = t.numel(), self._slots[i]
        if slot is None or slot[0].numel() < n or slot[0].dtype != t.dtype:
            slot = self._slots[i] = (torch.empty(max(n, 4096), dtype=t.dtype, pin_memory=True), torch.cuda.Event())
        buf, done = slot
        dst = buf[:n].view(t.shape)
        dst.copy_(t, non_blocking=True)
        done.record()
        return lambda: (done.synchronize(), dst.tolist())[1]


@dataclass
class MultiResult:
    """A multi-step forward on the device: tokens [Bp, S]; packed (its host copy's layout) or, for
    the step decoded ahead, the wait for its copy and each plan row's row in it."""

    tokens: torch.Tensor
    packed: torch.Tensor | None = None
    wait: Callable[[], list] | None = None
    rows: list[int] | None = None


@dataclass
class _Ahead:
    seq_ids: list[int]
    committed: dict[int, int]  # seq_id -> the committed length the step ahead starts from
    steps: int
    tokens: torch.Tensor  # [Bp, steps] (its graph's output, valid until that graph's next replay)
    wait: Callable[[], list]
    staged: Any = None  # a hybrid's Mamba states [Bp, steps, L, ...], staged when the step is used


class LaunchedAhead:
    """What a kind of step launched ahead shares (this module's plain decodes, spec/verify_ahead.py's
    verifies): the engine's say, the step in flight (with its seq_ids), the counts, and its discard."""

    def __init__(self, runner: Any, kv: Any, copies: HostCopies) -> None:
        self.runner, self.kv, self.copies = runner, kv, copies
        # the engine's say, per step (rows, tokens a row): whether the step after it may go ahead; None: never
        self.allowed: Callable[[list, int], bool] | None = None
        self._pending: Any = None
        self.launched = self.used = self.discarded = 0

    def stats(self) -> dict[str, int]:
        return {"launched": self.launched, "used": self.used, "discarded": self.discarded}

    def holds(self, seq_id: int) -> bool:
        """Whether seq_id's KV past this step is the step ahead's (its commit keeps the reservation)."""
        return self._pending is not None and seq_id in self._pending.seq_ids

    def discard(self) -> None:
        """Drops the step ahead: what it wrote past each live sequence's pointer is rolled back."""
        p, self._pending = self._pending, None
        if p is None:
            return
        self.discarded += 1
        live = set(self.kv.sequence_ids())
        for sid in p.seq_ids:
            if sid in live:
                self.kv.rollback(sid, self.kv.num_computed(sid))


class DecodeAhead(LaunchedAhead):

    def settle(self, running: list) -> bool:
        """Before the scheduler: keeps the step ahead if every running sequence is one it runs, at the
        committed length it assumed, decoding `steps` tokens plainly; else discards it. -> kept (then
        the step admits nobody: its batch is the step ahead's)."""
        p = self._pending
        if p is None:
            return False
        if running and all(p.committed.get(s.seq_id) == self.kv.num_computed(s.seq_id) and s.decode_steps == p.steps
                           and not s.spec_k for s in running):
            return True
        self.discard()
        return False

    def forward(self, plan: Any) -> MultiResult:
        """A multi-step plan's forward: the step ahead when it ran these rows, else a launch now."""
        p = self._pending
        if p is None:
            tokens, packed, _ = self.runner.run_multi(plan.rows, plan.multi)
            return MultiResult(tokens, packed)
        pos = {sid: i for i, sid in enumerate(p.seq_ids)}
        if plan.multi != p.steps or [p.committed.get(r.seq_id) for r in plan.rows] != plan.static.committed:
            raise RuntimeError("the step decoded ahead does not match the step scheduled (Engine.step settles it first)")
        self._pending = None
        self.used += 1
        rows = [pos[r.seq_id] for r in plan.rows]
        self.runner.stage(plan.rows, p.staged, rows)
        return MultiResult(p.tokens, wait=p.wait, rows=rows)

    def finish(self, plan: Any, res: MultiResult) -> StepOutput:
        """Launches the next step ahead when the engine allows it, then this step's one host sync ->
        its runs (every token kept: the engine cuts them)."""
        S, B = plan.multi, len(plan.rows)
        go = self.allowed is not None and self.allowed(plan.rows, S)
        wait = res.wait
        if wait is None:  # this step's copy goes first: the step ahead may replay the same graph
            wait = self.copies.start(res.packed[:B]) if go else res.packed[:B].tolist
        if go:
            self._launch(plan, res)
        host = wait()
        if res.rows is not None:
            host = [host[i] for i in res.rows]
        return StepOutput(*unpack(host, [S - 1] * B, S - 1))

    def _launch(self, plan: Any, res: MultiResult) -> None:
        S, rows = plan.multi, plan.rows
        try:
            for r in rows:  # this step's S tokens and the S ahead, from the pointer
                self.kv.reserve(r.seq_id, 2 * S)
        except NoFreeBlocksError:  # no room: the next step is built as usual (commit releases the rest)
            return
        B = len(rows)
        if res.rows is None or res.rows == list(range(B)):
            feed = res.tokens[:B, S - 1]
        else:
            feed = res.tokens[device_ints(res.rows, res.tokens.device), S - 1]
        if self.runner.ssm is not None:  # the step ahead starts from the states after this step's S tokens
            self.runner.ssm.write_staged_last()
        tokens, packed, staged = self.runner.run_multi(rows, S, advance=S, feed=feed, stage=False)
        self._pending = _Ahead([r.seq_id for r in rows], {r.seq_id: self.kv.num_computed(r.seq_id) + S for r in rows},
                               S, tokens, self.copies.start(packed[:B]), staged)
        self.launched += 1
