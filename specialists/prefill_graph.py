"""Prompts' prefills as CUDA graphs, at padded lengths: fresh ones, and one after a prefix hit.

An eager prefill runs at the host's pace: SmolLM2-135M's 30 layers are ~380 kernels at ~25-50 us of
host time each, so a 142-token prefill took 11-19 ms on an H100 of which 1.9 ms on the device
(bench/RESULTS.md, session 24); a hybrid's (bamba-1b) ~1,560 kernels took 45 ms. A prefill with nothing
cached before it, alone in its step, is padded here to the next length of PREFILL_LENGTHS and replayed
as one graph per length; a step of several such prompts (and nothing else) as one graph per (row
bucket, length), each prompt a row padded to the longest's length:

- the padding tokens come after the prompt, so causal attention keeps them out of the prompt's rows,
  and they write their K/V into the KV cache's scratch block (never read);
- every layer attends over the step's own k and v (ops/attention.attends_own_kv: flash attention
  with the causal bias, no block table, no context lengths), and the products run on the torch path
  (the padded length is past decode_fused.MAX_ROWS);
- the graph computes the logits of the prompt's last token (its index read on the device);
- a hybrid's Mamba layers run the padding with dt = 0, which leaves the state as the prompt left it,
  write each row's states to its slot in the graph, and put the states on the prefix cache's snapshot
  grid into `held` (ops/mamba2_padded.py), which `run` hands to the SSM cache for the step's snapshots.

Prompts after prefix hits (row b's new tokens after its c_b cached ones; a fresh prompt among them
has c_b = 0) are padded the same way, at positions c_b onwards, and replayed as one graph per (row
bucket, length, context width): their layers attend over each row's context gathered from the pool at
the width (batch.context_rows: masked by position; flash attention's variable-length form on CUDA), a
hybrid's Mamba layers start from the snapshots restored into their slots (a hit ends on the snapshot
grid, so the grid's counts run from its start). Every graph is captured on padding rows (scratch block and slot), also when a
request meets a shape first: a capture runs the forward twice, and a hybrid's reads its slot.

The padded prefill's products have more rows than the prompt, so in half precision its results may
differ in the last bits from an eager prefill of the same prompt (cuBLAS picks its kernels by the
row count), like any prefill next to a prefix hit; a speculative and a plain engine prefill alike.
Its hidden states and logits are views of the graph's outputs, valid until the next prefill graph
replays (the lengths share one memory pool, so another length's temporaries may overwrite them; the
step's drafter rebuild and sampling read them at once, and the catch-up log keeps none on CUDA:
runner.static).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from specialists.models.batch import ForwardBatch, SeqStep
from specialists.staging import BUCKETS, StaticInputs, bucket_size, context_width
from specialists.step_result import StepResult
from state.transfer import device_ints

__all__ = ["PREFILL_LENGTHS", "HeldStates", "PrefillGraphs", "prefill_length"]

_TOKEN_VIEWS = ("input_ids", "positions", "slot_mapping", "token_seq", "token_qidx")  # per token, the prompt's first
PREFILL_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192)  # the first is past decode_fused.MAX_ROWS (64)


def prefill_length(n: int, cap: int) -> int | None:
    """The padded length of an n-token prefill: the smallest of PREFILL_LENGTHS >= n; None past cap."""
    for length in PREFILL_LENGTHS:
        if n <= length <= cap:
            return length
    return None


@dataclass
class HeldStates:
    """A hybrid's grid states of a padded prefill (batch.held_out): conv [Bp, k, L, conv_dim, K-1] and
    ssm [Bp, k, L, H, P, N], after stride, 2 stride, ..., k stride tokens of each row."""

    stride: int
    conv: torch.Tensor
    ssm: torch.Tensor


class PrefillGraphs:
    """The runner's (specialists/runner.py) padded prefills: `shape` says whether a step is one, `run`
    runs it, `capture` captures every shape at warm-up on the scratch block. A step of several fresh
    prompts runs as one graph too: rows padded to one length, at most `cap` tokens in all, a row bucket
    of up to `max_rows` (the prompts' own batch is built apart, their hidden states gathered from the rows).
    Prompts after prefix hits (their new tokens after `c` cached ones) run as a graph per (row bucket,
    length, context width): each row's context gathered from the pool at the width, masked by position."""

    def __init__(self, runner: Any, cap: int, max_rows: int = 1, stride: int = 0) -> None:
        """stride: a hybrid's snapshot grid (state/ssm_snapshots.py; 0: no prefix cache, nothing held)."""
        self.runner, self.cap, self.max_rows, self.stride = runner, cap, max_rows, stride
        self.steps = self.hit_steps = 0  # prefill steps run padded, of them after a prefix hit
        self._pool = None  # one memory pool for every shape's graph: about the largest one's (prefills run one at a time)
        ssm, grid = runner.ssm, max((b * ((n - 1) // stride) for b, n, _ in self.shapes()), default=0) if stride else 0
        self._held = None if ssm is None or not grid else (  # every shape's grid states: views of one buffer
            ssm.conv.new_zeros(grid, *ssm.conv.shape[1:]), ssm.ssm.new_zeros(grid, *ssm.ssm.shape[1:]))

    def shapes(self) -> list[tuple[int, int, int]]:
        """(row bucket, length, context width; 0: fresh prompts) of every graph."""
        rows = [b for b in BUCKETS if b <= self.max_rows]
        fresh = [(b, n, 0) for b in rows for n in PREFILL_LENGTHS if b * n <= self.cap]
        return fresh + [(b, n, w) for b, n, _ in fresh for w in self.runner.context_widths() if w >= 2 * n]

    def _width(self, cached: list[int], length: int) -> int | None:
        """The context width of prompts of `length` padded tokens after `cached` ones (None: no graph)."""
        if self.stride and any(c % self.stride for c in cached):  # a hybrid's hit rows start on the snapshot grid
            return None
        w = context_width(max(cached) + length, self.runner.max_context_width)
        return w if max(cached) + length <= w else None

    def fits(self, new: list[int], cached: list[int]) -> bool:
        """Whether prompts of these new and cached token counts, alone in their step, prefill as a graph
        (the scheduler forms such steps apart from the running decodes: specialists/scheduler.py)."""
        return self._plan(new, cached) is not None

    def _plan(self, new: list[int], cached: list[int]) -> tuple[int, int, int] | None:
        """(row bucket, padded length, context width; 0: fresh) of a step of up to max_rows prompts with
        these new and cached token counts (a width where any row has a prefix hit); None: eager."""
        if not new or len(new) > self.max_rows:
            return None
        bp, length = bucket_size(len(new)), prefill_length(max(new), self.cap)
        if length is None or bp * length > self.cap:
            return None
        if not any(cached):
            return bp, length, 0
        width = self._width(cached, length)
        return (bp, length, width) if width is not None else None

    def shape(self, rows: list, static: bool) -> tuple[int, int, int] | None:
        """The graph shape (_plan) of a step of `rows` (runner.BatchRow), None unless every row is a
        prompt's prefill (no drafts) and they fit a graph."""
        if not static or not rows or any(not r.prefill or r.k for r in rows):
            return None
        return self._plan([len(r.tokens) for r in rows], [self.runner.kv.num_computed(r.seq_id) for r in rows])

    @torch.inference_mode()
    def run(self, rows: list, shape: tuple[int, int, int]) -> StepResult:
        bp, length, width = shape
        if self.runner.graphs.enabled and not self.runner.graphs.has(self._key(*shape)):
            self._capture(shape)  # on padding rows: a capture runs the forward twice, and a hybrid's reads its slots
        kv = self.runner.kv
        tables, starts = [kv.block_table(r.seq_id) for r in rows], [kv.num_computed(r.seq_id) for r in rows]
        self.steps += 1
        self.hit_steps += bool(width)
        padded = self._build(rows, bp, length, width, tables, starts)
        hidden, logits = self._replay(padded)
        if padded.held_out is not None:
            self._hold(rows, padded.held_out)
        if bp == 1:  # the prompt leads its row: its own batch is the padded one's first T tokens, the same buffers
            T = len(rows[0].tokens)
            real = replace(padded, **{f: getattr(padded, f)[:T] for f in _TOKEN_VIEWS}, query_lens=[T], max_query_len=T,
                           max_context_len=starts[0] + T, fresh_rows=False, context_rows=False, held_out=None)
            return StepResult(logits, hidden[:T], real)
        dev = self.runner.device
        real = ForwardBatch.build([SeqStep(r.seq_id, list(r.tokens), c, t) for r, t, c in zip(rows, tables, starts)], kv.block_size, dev)
        index = device_ints([b * length + j for b, r in enumerate(rows) for j in range(len(r.tokens))], dev)
        return StepResult(logits[: len(rows)], hidden[index], real)

    @torch.inference_mode()
    def capture(self, progress: bool = False) -> int:
        """Every shape's graph -> how many were captured."""
        if not self.runner.graphs.enabled:
            return 0
        missing = [s for s in self.shapes() if not self.runner.graphs.has(self._key(*s))]
        for shape in tqdm(missing, desc="prefill graphs", unit="shape", disable=not progress):
            self._capture(shape)
        if missing:
            self.warm_rows()
        return len(missing)

    @torch.inference_mode()
    def warm_rows(self, counts: tuple[int, ...] = (32, 64)) -> int:
        """Eager forwards of one padding prompt of each of `counts` tokens (scratch block and slot): an
        eager step of 17-64 rows (prompts admitted beside decodes) runs the fused products at their 32-
        and 64-row tiles (ops/decode_fused.mma), which Triton compiles at first use; a plain engine's
        decode graphs (at most 16 rows) never do, and a fresh process's first requests stalled for
        seconds (bench/RESULTS.md, session 27). -> the forwards run."""
        kv = self.runner.kv
        for n in counts:
            batch = self._build([self._pad_row()], 1, n, 0, [[kv.scratch_block] * -(-n // kv.block_size)], [0])
            self.runner.model.forward(batch, kv, self.runner.ssm)
        if torch.device(self.runner.device).type == "cuda":
            torch.cuda.synchronize()  # the staging buffer is rewritten by the next step
        return len(counts)

    def _capture(self, shape: tuple[int, int, int]) -> None:
        """A shape's graph on padding rows: one-token prompts in the scratch block and slot (after a
        prefix hit, their context the scratch block again and again)."""
        bp, length, width = shape
        kv = self.runner.kv
        table = [kv.scratch_block] * max(1, width // kv.block_size)
        self._replay(self._build([self._pad_row()] * bp, bp, length, width, [table] * bp, [max(width - length, 0)] * bp))
        torch.cuda.synchronize()  # the staging buffer is rewritten by the next step

    def _pad_row(self) -> SimpleNamespace:
        """A one-token prompt of no sequence, in the scratch slot (a capture's or warm-up's row)."""
        ssm = self.runner.ssm
        return SimpleNamespace(seq_id=-1, tokens=[0], ssm_slot=ssm.scratch_slot if ssm else -1)

    @staticmethod
    def _key(bp: int, length: int, width: int) -> tuple:
        return ("prefill", bp, length, width) if width else ("prefill", bp, length)

    def _hold(self, rows: list, held: HeldStates) -> None:
        """Each prompt's grid states that its snapshot plan wants (SSMSnapshots.plan: the grid's counts
        inside the prompt, the first of the k the graph computed) to the SSM cache, for the step's capture."""
        ssm, g = self.runner.ssm, held.stride
        for b, r in enumerate(rows):
            want = ssm.prefill_counts(r.ssm_slot)
            if want != list(range(g, g * len(want) + 1, g)) or len(want) > held.conv.shape[1]:
                raise AssertionError(f"seq {r.seq_id}: snapshot counts {want} are not the first of a {g}-token grid")
            for layer in range(held.conv.shape[2]) if want else ():
                ssm.hold(layer, r.ssm_slot, held.conv[b, :len(want), layer], held.ssm[b, :len(want), layer])

    def _replay(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        runner = self.runner
        runner._check_generation()
        model = runner.model

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            batch.__dict__.pop("_attn_meta", None)
            hidden = model.forward(batch, runner.kv, runner.ssm)  # [length, d]
            return hidden, model.logits(hidden[batch.logits_indices]).float()

        if self._pool is None and runner.graphs.enabled:
            self._pool = torch.cuda.graph_pool_handle()
        width = batch.max_context_len if batch.context_rows else 0
        return runner.graphs.run(self._key(batch.num_seqs, batch.max_query_len, width), forward, self._pool)

    def _build(self, rows: list, bp: int, length: int, width: int, tables: list[list[int]], starts: list[int]) -> ForwardBatch:
        """The padded batch: row b's new tokens at b * length (positions from starts[b], its cached
        tokens), the padding after each (and rows past the prompts: all padding) in the scratch block;
        block tables as wide as the padded length or the context width (zeros past each prompt's blocks:
        the CPU's mask reads them), context lengths and query starts the prompts' own (a fresh prompt's
        graph reads neither; after a hit the mask comes from the positions)."""
        runner = self.runner
        inp, bs, n = runner.inputs, runner.kv.block_size, bp * length
        inp.wait_upload()
        cols = max(max(len(t) for t in tables), -(-max(length, width) // bs))
        inp.ensure(n, bp, cols)
        ids, pos, slots, tseq, tq, lidx = (inp.staging(f, n) for f in StaticInputs.TOKEN_FIELDS)
        j = np.tile(np.arange(length), bp)
        first = np.repeat(np.asarray(starts + [0] * (bp - len(rows))), length)
        ids[:], pos[:], tseq[:], tq[:] = 0, first + j, np.repeat(np.arange(bp), length), j
        slots[:] = runner.kv.scratch_block * bs + j % bs
        tab = inp.tables(bp, cols)
        tab[:] = 0
        lens = [len(r.tokens) for r in rows] + [1] * (bp - len(rows))
        for b, (r, t, c) in enumerate(zip(rows, tables, starts)):
            k = c + np.arange(lens[b])
            ids[b * length:b * length + lens[b]] = r.tokens
            slots[b * length:b * length + lens[b]] = np.asarray(t)[k // bs] * bs + k % bs
            tab[b, :len(t)] = t
        lidx[:bp] = np.arange(bp) * length + np.asarray(lens) - 1
        inp.staging("query_start_loc", bp + 1)[:] = np.concatenate([[0], np.cumsum(lens)])
        inp.staging("context_lens", bp)[:] = np.asarray(lens) + np.asarray(starts + [0] * (bp - len(rows)))
        ssm = runner.ssm  # a hybrid: its rows' slots, the padding rows' the scratch one
        inp.staging("ssm_slots", bp)[:] = [r.ssm_slot for r in rows] + [ssm.scratch_slot] * (bp - len(rows)) if ssm else -1
        inp.upload()
        dv = inp.device_view
        k = (length - 1) // self.stride if self._held is not None else 0
        held = HeldStates(self.stride, *(t[: bp * k].view(bp, k, *t.shape[1:]) for t in self._held)) if k else None
        return ForwardBatch(
            input_ids=dv("input_ids", n), positions=dv("positions", n), seq_ids=[r.seq_id for r in rows] + [-1] * (bp - len(rows)),
            query_start_loc=dv("query_start_loc", bp + 1), context_lens=dv("context_lens", bp),
            block_tables=inp.tables(bp, cols, device=True), slot_mapping=dv("slot_mapping", n), ssm_slots=dv("ssm_slots", bp),
            logits_indices=dv("logits_indices", bp), query_lens=[length] * bp, is_prefill=[True] * bp,
            token_seq=dv("token_seq", n), token_qidx=dv("token_qidx", n), max_query_len=length,
            max_context_len=width or length, num_pad=bp - len(rows), fresh_rows=not width, context_rows=bool(width), held_out=held)
