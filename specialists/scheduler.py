"""Continuous batching: admission by free blocks and SSM slots, decode of running sequences,
preemption by recompute when blocks run out.

Each step the scheduler returns the sequences to run: running sequences decode one token each; while
there is room (sequences, token budget, KV blocks, SSM slots) waiting sequences are admitted and
prefilled. When a running sequence cannot get a block for its next token, the most recently admitted
sequence is preempted: its KV blocks and SSM slot are freed and it goes back to the front of the
queue, to be prefilled again over prompt + output (recompute).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from spec.stats import RequestStats
from specialists.sampling import SamplingParams
from state.block_pool import NoFreeBlocksError
from state.kv_cache import KVCache
from state.ssm_cache import SSMCache
from state.ssm_snapshots import SSMSnapshots
from specialists.draft_marks import DraftMarks

log = logging.getLogger(__name__)


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """A request's state. Who changes what: the scheduler moves it between queues (admit, preempt,
    finish: status, ssm_slot, finish_reason) and may drop its drafts; the engine sets its drafts for
    the step (spec_k), appends its emitted tokens and text, and marks the drafter's coverage; the
    speculator only reads it."""

    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    ssm_slot: int = -1
    finish_reason: str | None = None
    text: str = ""
    detok: tuple = (0, "", None)  # specialists/detok.py: (tokens, text, last token) of the stable prefix
    generator: torch.Generator | None = None
    spec_k: int = 0  # drafts to verify this step (set by the engine before scheduling)
    decode_steps: int = 1  # greedy plain decodes this step may run in one forward (specialists/multistep.py)
    pad_k: int = 0  # with spec_k 0 among speculating rows: drafts it verifies but never keeps, so the step stays static
    in_tool: bool = False  # inside a tool-call segment: decoded without speculation
    guide: Any = None  # spec.grammar.Guide: the request's grammar (None: free text)
    draft_ok: bool = False  # the drafter's entries cover every committed token
    drafted_all: bool = True  # every step wrote them and its prefix hit had them (specialists/draft_marks.py)
    stats: RequestStats = field(default_factory=RequestStats)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:  # len(all_ids), without building the list (the engine asks every step)
        return len(self.prompt_ids) + len(self.output_ids)

    # ---- transitions (scheduler) ---------------------------------------------------------------

    def admit(self, ssm_slot: int) -> None:
        self.status, self.ssm_slot = Status.RUNNING, ssm_slot

    def preempt(self) -> None:
        """Back to waiting, to be prefilled again over prompt + output: its blocks and slot are gone."""
        self.status, self.ssm_slot, self.draft_ok = Status.WAITING, -1, False

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason, self.ssm_slot = Status.FINISHED, reason, -1

    # ---- per step (engine) ---------------------------------------------------------------------

    def emit(self, tokens: list[int]) -> None:
        """Tokens kept this step (after the cut at triggers), now committed."""
        self.output_ids.extend(tokens)


@dataclass
class ScheduledStep:
    prefills: list[tuple[Sequence, list[int]]]  # (sequence, tokens to prefill)
    decodes: list[Sequence]  # each feeds its last sampled token

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


def _counts(prefills: list[tuple[Sequence, list[int]]]) -> tuple[list[int], list[int]]:
    """(new tokens, cached tokens) of each admitted prefill."""
    return [len(t) for _, t in prefills], [len(s.all_ids) - len(t) for s, t in prefills]


class Scheduler:
    def __init__(self, kv: KVCache, ssm: SSMCache | None, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.ssm = ssm
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        self.draft_lookahead = False  # reserve room for a chain drafted ahead (spec/speculator.py)
        self.snapshots: SSMSnapshots | None = None  # a hybrid's prefix hits end where a Mamba state is kept
        self.draft_marks: DraftMarks | None = None  # with a drafter: which cached blocks hold its entries
        # (new tokens, cached tokens) of prompts that prefill as one CUDA graph when alone in their step
        # (specialists/prefill_graph.py); None: never. With it prompts and decodes never share a step: the running
        # decodes wait one step for the prompts' (a graph, or eager past the cap), and the step after it is theirs
        # alone (their graph: no eager mixed step, whose products change bits with its row count)
        self.prefill_alone: Callable[[list[int], list[int]], bool] | None = None
        self._decodes_waited = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def mark_drafts(self, copy_block: Callable[[int, int], None] | None) -> None:
        """Track which cached blocks hold the drafter's entries (given the drafter's block copy: an engine
        with a drafter and the prefix cache)."""
        self.draft_marks = DraftMarks(self.kv, copy_block) if copy_block is not None else None

    def _usable(self, speculating: bool) -> Callable[[int], bool] | None:
        """Where a prefix hit may end: a hybrid's at a kept Mamba state, a speculating step's on blocks
        that hold the drafter's entries too; None: anywhere."""
        checks = [self.snapshots.has] if self.snapshots is not None else []
        if self.draft_marks is not None and speculating:
            checks.append(self.draft_marks.usable)
        return None if not checks else checks[0] if len(checks) == 1 else (lambda e: all(f(e) for f in checks))

    def guided(self) -> bool:
        """Whether a grammar is active in a running sequence or in one the next step admits."""
        admitted = itertools.islice(self.waiting, max(0, self.max_num_seqs - len(self.running)))
        return any(seq.guide is not None and seq.guide.active for seq in itertools.chain(self.running, admitted))

    def schedule(self, speculating: bool = False, admit: bool = True) -> ScheduledStep:
        """The step's decodes and the prefills admitted (speculating: a prefix hit ends on blocks that
        hold the drafter's entries; admit False: none, the batch is a step decoded ahead's). With
        prefill_alone (prefill graphs), admission stops where the step would stop being one prefill graph,
        and a step of prompts (a graph, or a prompt past the cap, eagerly) runs without the decodes (a
        speculating step's rebuild keeps the waiting sequences' chain starts: spec/speculator.py's
        _rebuild); the step after it runs the decodes alone.
        A half-precision step past decode_fused.MAX_ROWS rows is eager, through products whose bits move
        with the row count: prompts mixed with a verify's rows would prefill other bits than beside the
        same decodes plain, and speculative output would differ from plain (tests/test_cuda_half_paths.py)."""
        usable = self._usable(speculating)
        decodes = self._schedule_decodes()
        if self._decodes_waited and decodes:
            admit = False
        prefills: list[tuple[Sequence, list[int]]] = []
        apart = self.prefill_alone is not None  # prompts and decodes in steps of their own
        budget = self.max_num_batched_tokens - (0 if apart else len(decodes))
        while admit and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            ids = seq.all_ids
            if len(ids) > budget and (prefills or (decodes and not apart)):
                break
            if not self.kv.can_allocate(len(ids) + 1) or (self.ssm is not None and self.ssm.num_free() == 0):
                break
            if self.prefill_alone is not None and prefills and self._ends_graph(prefills, ids, usable):
                break  # the prompts so far run as one prefill graph; this one would make the step eager
            cached = self.kv.add_sequence(seq.seq_id, ids, usable)
            if cached and self.draft_marks is not None and not self.draft_marks.hit_marked(seq.seq_id, cached):
                seq.drafted_all = False
            try:
                self.kv.reserve(seq.seq_id, len(ids) - cached)
            except NoFreeBlocksError:
                self.kv.free(seq.seq_id)
                break
            self.waiting.popleft()
            self.prefix_hit_tokens += cached
            seq.admit(self.ssm.allocate() if self.ssm is not None else -1)
            if cached and self.snapshots is not None:  # KV and Mamba state of the same prefix
                self.snapshots.restore(seq.seq_id, seq.ssm_slot, cached)
            self.running.append(seq)
            prefills.append((seq, ids[cached:]))
            budget -= len(ids) - cached
        if decodes and prefills and apart:  # a graph, or eager (past the graphs' cap)
            if not speculating:  # no rebuild to keep the drafter outputs their chains start from (spec/speculator.py):
                for waits in decodes:  # they draft again after a step that rebuilds them
                    waits.draft_ok = False
            self._decodes_waited = True
            return ScheduledStep(prefills, [])  # the decodes wait a step: the prompts alone, not one eager mixed step
        self._decodes_waited = False
        return ScheduledStep(prefills, decodes)

    def _ends_graph(self, prefills: list[tuple[Sequence, list[int]]], ids: list[int], usable) -> bool:
        """Whether the prompts admitted so far run as one prefill graph (up to 8 rows of one padded length,
        fresh or after prefix hits: specialists/prefill_graph.py) and admitting the prompt `ids` too (with
        the prefix it would find cached) would not; the rest waits a step."""
        new, cached = _counts(prefills)
        if not self.prefill_alone(new, cached):
            return False
        hit = self.kv.cached_prefix(ids, usable)
        return not self.prefill_alone(new + [len(ids) - hit], cached + [hit])

    def plan_drafts(self, k: int, steps: int, static: bool, max_model_len: int) -> None:
        """Each running sequence's drafts this step: k, fewer near its limits, none in a tool call; how many
        greedy plain decodes it may run in one forward (steps, fewer near max_model_len); and, on static
        steps, the drafts a row without its own verifies unkept beside speculating rows (pad_k: the step
        stays one static shape, a CUDA graph, instead of an eager mixed step; spec/speculator.py)."""
        for seq in self.running:
            room = max_model_len - seq.num_tokens - 1  # past max_model_len: no KV room
            if not static:  # static steps draft past max_tokens and cut (one graph per K)
                room = min(room, seq.params.max_tokens - len(seq.output_ids) - 1)
            seq.spec_k = max(0, min(k, room)) if (seq.draft_ok and not seq.in_tool) else 0
            # greedy plain decodes of a static batch: several per step (past max_tokens too, then cut)
            seq.decode_steps = max(1, min(steps, room + 1)) if seq.params.greedy and not seq.spec_k else 1
        top = max((seq.spec_k for seq in self.running), default=0)
        for seq in self.running:
            fits = static and seq.draft_ok and seq.spec_k < top <= max_model_len - seq.num_tokens - 1
            seq.pad_k = top if fits else 0

    def _schedule_decodes(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted while making room for an earlier one
            while True:
                try:
                    # room for [last, d1..dk], and with draft_lookahead for the k-1 chained entries the
                    # drafter writes past the accepted ones when it drafts the next step ahead
                    k = max(seq.spec_k, seq.pad_k)
                    extra = k - 1 if self.draft_lookahead and k else 0
                    self.kv.reserve(seq.seq_id, max(1 + k + extra, seq.decode_steps))
                    scheduled.append(seq)
                    break
                except NoFreeBlocksError:
                    if seq.spec_k or seq.pad_k or seq.decode_steps > 1:  # drop the drafts and steps ahead before preempting anyone
                        seq.spec_k, seq.pad_k, seq.decode_steps = 0, 0, 1
                        continue
                    victim = self.running[-1]
                    self.preempt(victim)
                    if victim is seq:
                        break
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        log.info("preempting %s (%d tokens) to free KV blocks", seq.request_id, seq.num_tokens)
        self._release(seq)
        seq.preempt()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """A running sequence is done: its blocks and slot are freed (its drafter entries marked first)."""
        if self.draft_marks is not None and seq.drafted_all:
            self.draft_marks.mark(seq.seq_id)
        self._release(seq)
        seq.finish(reason)

    def drafter_wrote(self, seq: Sequence, rebuilt: bool) -> None:
        """After a step's commit, before its outputs (a sequence that finishes there marks its blocks by
        drafted_all): whether the drafter wrote seq's entries this step."""
        seq.draft_ok, seq.drafted_all = rebuilt, seq.drafted_all and rebuilt

    def abort_waiting(self, seq: Sequence) -> None:
        """A waiting sequence is dropped (it holds no blocks or slot)."""
        self.waiting.remove(seq)
        seq.finish("abort")

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        if self.ssm is not None and seq.ssm_slot >= 0:
            self.ssm.free(seq.ssm_slot)
