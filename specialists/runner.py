"""One target forward for a scheduled step: builds the flattened batch in static buffers, runs the
model, returns the logits rows acceptance needs and every token's hidden state (the drafter rebuilds
its entries from them).

Rows (`BatchRow`) are prefills (their new tokens; logits of the last one) and decodes / verifies
([last token, d1..dk]; logits of each). Draft tokens are still on the device when the batch is
built: the runner writes placeholders in the staging buffer and places the drafts tensor over them
on the device, so no sync is needed between drafting and verification.

Static buffers: every index tensor of a batch (token ids, positions, KV slots, block tables, ...)
is a view into one int64 buffer allocated once (and grown only when a step needs more room). The
host fills a staging copy and the device gets it in one copy (on CPU the staging buffer is the
device buffer). Batch-size buckets: a batch of decodes or verifies that all feed the same number of
tokens (the steady state of a serving engine) is padded to the next bucket size (1, 2, 4, 8, ...)
with rows that read the KV cache's scratch block and the SSM cache's scratch slot and write nothing
that is ever read, so a step's shapes come from a small fixed set, which is what CUDA graph capture
and shape-specialized kernels need. Padding is on by default on CUDA and off on CPU, where padded
rows are only extra work.

CUDA graphs (specialists/graphs.py): a step whose rows all decode or verify the same number of
tokens is a *static* batch: padded to its bucket, its block tables at the buffers' full width, and
its attention over a context width W from a few buckets (256, 512, 1024, ... up to the longest
sequence) with the lengths read on the device, so that the forward (plus the argmax and, for a
speculating greedy step, the drafter's rebuild) is one graph per (bucket, tokens per row, W) that is
captured once and replayed. A static batch stages even a plain decode's Mamba states (staged_states.py;
the commit writes the slots), which lets a graph run twice to the same effect. The graph also does its
rows' greedy acceptance (spec/acceptance.py) and packs the step's host copy. Prefills and mixed steps run
eagerly. On by default on CUDA; `static_batches` (options.py) runs the static forward eagerly (CPU tests).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from spec.acceptance import greedy_accept, pack
from specialists.graphs import GraphCache
from specialists.models.batch import ForwardBatch, SeqStep
from specialists.multistep import multi_decode
from specialists.options import EngineConfig
from specialists.prefill_graph import PrefillGraphs
from specialists.ops.rows_cuda import row_argmax
from specialists.static_masks import StaticMask, StaticMasks
from specialists.step_result import Staged, StaticOutputs, StepResult
from specialists.staged_states import StagedBuffers, budget_mib
from specialists.staging import (BUCKETS, MAX_GRAPH_BATCH, MIN_CONTEXT_WIDTH, Layout, StaticInputs, advance_rows, bucket_size,
                                 context_width, exact_rows, pad_rows, place_drafts, stage_rows)
from state.kv_cache import KVCache
from state.ssm_cache import SSMCache
from state.transfer import device_ints

Rebuild = Callable[[ForwardBatch, torch.Tensor, torch.Tensor], torch.Tensor]  # (batch, hidden, next tokens) -> entries


def _step_key(rows: int, q: int, width: int, rebuild: Rebuild | None, masked: bool = False) -> tuple:
    """The graph key of a static step: its shape, whether the drafter's rebuild is in it, and whether
    it masks its logits with grammars (specialists/static_masks.py)."""
    return ("step", rows, q, width, rebuild is not None) + (("masked",) if masked else ())


class BatchRow(NamedTuple):
    """One row of a step as the runner sees it."""

    seq_id: int
    tokens: list[int]  # the host tokens it feeds: a prefill's new tokens, or a decode's last token
    prefill: bool
    ssm_slot: int
    k: int = 0  # drafts fed after `tokens` (a verify), placed from the drafts tensor on the device

    @property
    def q(self) -> int:
        return len(self.tokens) + self.k


class Runner:
    def __init__(self, model, kv: KVCache, ssm: SSMCache | None, cfg: EngineConfig) -> None:
        self.model, self.kv, self.ssm = model, kv, ssm
        self.device = cfg.device
        self.pad_batches = cfg.pad_batches
        self.decode_steps = cfg.decode_steps  # greedy decodes per static step (multistep.py; hybrids carry their state)
        self.static = cfg.static_batches  # padded decode / verify batches of one shape run static (graphs)
        blocks = -(-cfg.max_model_len // kv.block_size) + 2
        # block tables for max_model_len (+ a verify's lookahead); room for the largest step the scheduler forms
        # (a bigger prefill would reallocate the buffers and drop every graph: ~30 ms a step at 1B, batch 8)
        self.inputs = StaticInputs(self.device, max_tokens=max(256, 8 * cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len),
                                   max_seqs=max(16, bucket_size(cfg.max_num_seqs)), max_blocks=max(64, blocks))
        self.graphs = GraphCache(cfg.cuda_graphs)
        # a hybrid decoding ahead alternates between two copies of each multi-step graph (run_multi): bamba-1b's
        # staged states are 96 MB a row (4 tokens x 12 layers x 2 MB), so only where a step ahead needs them
        self._copies = 2 if ssm is not None and cfg.decode_ahead else 1
        self._parity = 0
        budget = budget_mib(cfg.staged_state_mib, cfg.device)
        self.staged = StagedBuffers(ssm.conv, ssm.ssm, budget, min(bucket_size(cfg.max_num_seqs), MAX_GRAPH_BATCH)) \
            if ssm is not None and cfg.static_batches else None  # a hybrid's staged states (and their budget)
        self._staged_tokens = self.staged.max_tokens if self.staged is not None else 1 << 30  # the most a step stages
        self.static_masks = StaticMasks(model.lm_head.shape[0], self.device) if cfg.fused_drafter and cfg.static_batches else None  # guided steps
        self._generation = self.inputs.generation
        # steps with padding rows, as static batches (graphs on CUDA), of those masked by grammars in the step
        self.padded_steps = self.static_steps = self.masked_steps = 0
        self.row_exact = cfg.quantization != "none"  # quantized products: row-canonical attention (batch.row_exact)
        self.exact_rows = exact_rows(self.device, model.lm_head.dtype)  # rows a step's products stay row-invariant
        cap = min(cfg.prefill_graph_tokens, self.inputs.max_tokens, self.max_context_width)  # prompts' prefill graphs
        self.prefills = PrefillGraphs(self, cap, min(bucket_size(cfg.max_num_seqs), 8), cfg.ssm_snapshot_stride or 0) \
            if cap and not self.row_exact else None
        self.lone_prefill = self.prefills.fits if self.prefills is not None else None  # the scheduler's prefill_alone
        if torch.device(self.device).type == "cuda" and getattr(model, "rope", None) is not None:
            model.rope.tabulate(self.max_context_width, model.embed.dtype)  # RoPE rows gathered, not computed

    # ---- shapes ------------------------------------------------------------------------------

    @property
    def max_context_width(self) -> int:
        return self.inputs.max_blocks * self.kv.block_size

    def context_widths(self) -> list[int]:
        """Every attention width a static batch can have."""
        out = [context_width(1, self.max_context_width)]
        while out[-1] < self.max_context_width:
            out.append(context_width(out[-1] + 1, self.max_context_width))
        return out

    def graph_shapes(self, max_rows: int) -> list[tuple[int, int]]:
        """(batch bucket, context width) of every static batch of at most max_rows rows."""
        buckets = [b for b in BUCKETS if b <= min(bucket_size(max_rows), MAX_GRAPH_BATCH)]
        return [(b, w) for b in buckets for w in self.context_widths()]

    def static_shape(self, num_rows: int, max_context: int) -> tuple[int, int]:
        """(padded rows, attention width) of a static batch of num_rows rows, the longest context max_context."""
        return bucket_size(num_rows), context_width(max_context, self.max_context_width)

    def max_drafts(self, num_rows: int) -> int:
        """The most drafts a row may verify: output exact (staging.exact_rows), a hybrid's staged states
        within their budget (staged_states.py)."""
        return max(0, min(self.exact_rows, self._staged_tokens) // bucket_size(num_rows) - 1)

    def multi_steps(self, num_rows: int) -> int:
        """Greedy decodes per static plain step at this batch size: decode_steps, fewer where a hybrid's
        staged states would pass their budget."""
        return max(1, min(self.decode_steps, self._staged_tokens // bucket_size(num_rows)))

    def static_batch(self, num_rows: int, q: int) -> bool:
        """Whether a batch of num_rows decode / verify rows of q tokens each runs static (a graph)."""
        return self.static and q <= self.kv.block_size and bucket_size(num_rows) <= MAX_GRAPH_BATCH

    # ---- batches -----------------------------------------------------------------------------

    def build(self, rows: list[BatchRow], lookahead: int = 0, static: bool = True,
              advance: int = 0) -> tuple[ForwardBatch, ForwardBatch]:
        """rows -> (the padded batch the model runs, the real rows' batch: a prefix of the same buffers);
        a static batch's width also covers `lookahead` more tokens per row (multi-step decodes); static
        False: eager whatever the shape (a step whose logits are masked before acceptance); `advance`:
        each row starts that many positions past its committed end (a step decoded ahead)."""
        if not rows:
            raise ValueError("empty batch")
        self.inputs.wait_upload()  # a step decoded ahead may still be copying the staging buffer
        starts = [self.kv.num_computed(r.seq_id) + advance for r in rows]
        tables = [self.kv.block_table(r.seq_id) for r in rows]
        lay = self._layout(rows, tables, static)
        n_logits = stage_rows(self.inputs, rows, starts, tables, lay, self.kv.block_size)
        if lay.Bp > lay.B:
            pad_rows(self.inputs, self.kv, self.ssm, lay.B, lay.Bp, lay.T, lay.q_pad, lay.static, lay.width)
        self.inputs.upload()
        ctx = self.inputs.staging("context_lens", lay.Bp)
        max_ctx = int(ctx.max())
        if lay.static:
            max_ctx = context_width(max_ctx + lookahead, self.max_context_width)
            self.static_steps += 1
        B, qlens = lay.B, [r.q for r in rows]

        def batch(nb: int, nt: int, nl: int) -> ForwardBatch:
            return self._views(lay, nb, nt, nl, [r.seq_id for r in rows] + [-1] * (nb - B),
                               qlens + [lay.q_pad] * (nb - B), [r.prefill for r in rows] + [False] * (nb - B),
                               max_ctx if lay.static else int(ctx[:nb].max()))

        real = batch(B, lay.T, n_logits)
        return (batch(lay.Bp, lay.Tp, lay.Tp if lay.static else n_logits) if lay.Bp > B else real), real

    def history_batch(self, spans: list[tuple[int, int, int]]) -> ForwardBatch:
        """(seq_id, start, n): positions a sequence already committed -> an eager batch over them, apart
        from the step's buffers (the drafter's catch-up, spec/catchup.py)."""
        steps = [SeqStep(sid, [0] * n, start, self.kv.block_table(sid), True, "none") for sid, start, n in spans]
        return ForwardBatch.build(steps, self.kv.block_size, self.device)

    def _layout(self, rows: list[BatchRow], tables: list[list[int]], allow_static: bool = True) -> Layout:
        qlens = [r.q for r in rows]
        if 0 in qlens:
            raise ValueError(f"seq {rows[qlens.index(0)].seq_id}: no new tokens")
        B, q = len(rows), qlens[0]
        uniform = not any(r.prefill for r in rows) and len(set(qlens)) == 1
        static = allow_static and uniform and self.static_batch(B, q)
        pad = 0
        if static or (self.pad_batches and uniform and q <= self.kv.block_size):
            pad = bucket_size(B) - B
            self.padded_steps += pad > 0
        T = sum(qlens)
        width = max(max(len(t) for t in tables), 1)
        self.inputs.ensure(T + pad * q, B + pad, width)
        if static:  # the full width: a graph's views do not depend on the step
            width = self.inputs.max_blocks
        return Layout(B=B, T=T, Bp=B + pad, Tp=T + pad * q, q_pad=q, width=width, static=static, uniform=uniform)

    def _views(self, lay: Layout, nb: int, nt: int, nl: int, seq_ids: list[int], qlens: list[int],
               is_prefill: list[bool], max_ctx: int) -> ForwardBatch:
        """A ForwardBatch of the first nb rows / nt tokens / nl logits rows (those past lay.B are
        padding), as views of the device buffers."""
        inp = self.inputs
        dv = inp.device_view
        return ForwardBatch(
            input_ids=dv("input_ids", nt), positions=dv("positions", nt), seq_ids=seq_ids,
            query_start_loc=dv("query_start_loc", nb + 1), context_lens=dv("context_lens", nb),
            block_tables=inp.tables(lay.Bp, lay.width, device=True)[:nb], slot_mapping=dv("slot_mapping", nt),
            ssm_slots=dv("ssm_slots", nb), logits_indices=dv("logits_indices", nl), query_lens=qlens,
            is_prefill=is_prefill, token_seq=dv("token_seq", nt), token_qidx=dv("token_qidx", nt),
            max_query_len=max(qlens), max_context_len=max_ctx, ssm_slot_list=inp.staging("ssm_slots", nb).tolist(),
            num_pad=nb - lay.B, static=lay.static, row_exact=self.row_exact,
        )

    # ---- forward -----------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, rows: list[BatchRow], drafts: torch.Tensor | None = None, rebuild: Rebuild | None = None,
            static: bool = True, masks: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> StepResult:
        """One target forward. drafts [n, kmax] (device): see staging.place_drafts. `rebuild` (a static batch
        only): the drafter's rebuild, run after the forward (in its graph) with each token's argmax as
        the next token. static False: eager (its logits are masked before acceptance). `masks` (a
        static batch, with static_masks): grammar mask words per real logits row and the closing bonus,
        applied in the graph before the argmax (StepResult.static.masked)."""
        shape = self.prefills.shape(rows, static) if self.prefills is not None else None
        if shape is not None:  # fresh prompts, padded: a graph per (rows, length) (prefill_graph.py)
            return self.prefills.run(rows, shape)
        batch, real = self.build(rows, static=static)
        if drafts is not None:
            place_drafts(batch, rows, drafts)
        if not batch.static:
            hidden = self.model.forward(batch, self.kv, self.ssm)[: real.num_tokens]  # [T, d]
            return StepResult(self.model.logits(hidden[real.logits_indices]).float(), hidden, real)
        mask = None
        if masks is not None and self.static_masks is not None:
            mask = self.static_masks.stage(batch.num_seqs * batch.max_query_len, *masks)
            self.masked_steps += 1
        out = self._static_step(batch, rebuild, mask)
        self.stage(rows, out.staged)
        T = real.num_tokens
        return StepResult(out.logits[:T], out.hidden[:T], real, out)

    @torch.inference_mode()
    def run_ahead(self, rows: list[BatchRow], packed: torch.Tensor, drafts: torch.Tensor, rebuild: Rebuild | None) -> StepResult:
        """The verify after a greedy static one, before the host reads it (spec/verify_ahead.py): built at
        the rows' committed ends, wide enough for q more tokens, then moved on the device past what that
        verify keeps (staging.advance_rows: its packed result, `drafts` [Bp, q-1] after each target token)."""
        batch, real = self.build(rows, lookahead=rows[0].q)
        advance_rows(batch, packed, drafts, len(rows), self.kv.block_size)
        out = self._static_step(batch, rebuild)
        return StepResult(out.logits[:real.num_tokens], out.hidden[:real.num_tokens], real, out)

    @torch.inference_mode()
    def run_multi(self, rows: list[BatchRow], steps: int, advance: int = 0, feed: torch.Tensor | None = None,
                  stage: bool = True) -> tuple[torch.Tensor, torch.Tensor, Staged | None]:
        """`steps` greedy one-token decodes of every row (a static batch) in one graph
        (specialists/multistep.py) -> (tokens [Bp, steps], packed [Bp, 2 steps], a hybrid's Mamba states
        [Bp, steps, L, ...] or None) on the device; with `stage` the states are staged for the commit.
        `advance`, `feed`, stage False (spec/decode_ahead.py): each row starts `advance` positions past its
        committed end, from the token feed[b] on the device (not its host token), from the Mamba states
        in its slot (the step before wrote its last ones there), and its states are staged when it is used.
        A hybrid's consecutive calls replay two copies of the graph in turn, so a step's states stay
        intact while the step decoded ahead of it runs (its commit comes after that launch)."""
        batch, _ = self.build(rows, lookahead=steps - 1, advance=advance)
        if not batch.static:
            raise ValueError("multi-step decodes need a static batch")
        if feed is not None:
            batch.input_ids[: feed.shape[0]].copy_(feed)
        self._parity = (self._parity + 1) % self._copies
        tokens, packed, staged = self._multi_step(batch, steps, self._parity)
        if stage:
            self.stage(rows, staged)
        return tokens, packed, staged

    def stage(self, rows: list[BatchRow], staged: Staged | None, order: list[int] | None = None) -> None:
        """A static step's Mamba states of each token (real rows only), for the commit after acceptance;
        `order`: row b's states are the staged row order[b] (a step decoded ahead over more rows)."""
        if staged is not None:
            B = len(rows)
            conv, ssm = (staged.conv[:B], staged.ssm[:B]) if order is None or order == list(range(B)) else \
                (staged.conv[device_ints(order, staged.conv.device)], staged.ssm[device_ints(order, staged.ssm.device)])
            self.ssm.stage_all([r.ssm_slot for r in rows], conv, ssm)

    def _multi_step(self, batch: ForwardBatch, steps: int, parity: int = 0) -> tuple[torch.Tensor, torch.Tensor, Any]:
        self._check_generation()
        key = self._multi_key(batch.num_seqs, steps, batch.max_context_len, parity)
        return self.graphs.run(key, lambda: multi_decode(  # the staged views are made at capture only, not per replay
            self.model, self.kv, batch, steps, self.ssm,
            self.staged.views(("multi", parity), batch.num_seqs, steps) if self.staged is not None else None))

    def _multi_key(self, rows: int, steps: int, width: int, parity: int) -> tuple:
        """The graph key of a multi-step decode; a hybrid decoding ahead has a copy per parity (run_multi)."""
        return ("multi", rows, steps, width) + ((parity,) if self._copies > 1 else ())

    def _check_generation(self) -> None:
        if self.inputs.generation != self._generation:  # the buffers were reallocated
            self.graphs.clear()
            self._generation = self.inputs.generation

    def _static_step(self, batch: ForwardBatch, rebuild: Rebuild | None, mask: StaticMask | None = None) -> StaticOutputs:
        """The graph of a static batch (captured on its shape's first call): forward, logits, argmax,
        the rows' greedy acceptance packed for the host and, given, the drafter's rebuild."""
        self._check_generation()

        def step() -> StaticOutputs:
            batch.__dict__.pop("_attn_meta", None)  # built inside the graph, from the static buffers
            if self.staged is not None:  # a hybrid's states go to the role's buffer (views made at capture only)
                batch.staged_out = self.staged.views("step", batch.num_seqs, batch.max_query_len)
            hidden = self.model.forward(batch, self.kv, self.ssm)  # [Tp, d]
            logits = self.model.logits(hidden).float()
            if mask is not None:  # a guided step's grammar masks (static buffers)
                mask.apply(logits)
            best = row_argmax(logits)
            staged = batch.staged_out  # a hybrid's: [Bp, q, L, ...] per-token states of every Mamba layer
            fed = batch.input_ids.view(batch.num_seqs, -1)[:, 1:]  # [Bp, q-1] the drafts verified
            packed = pack(greedy_accept(best.view(batch.num_seqs, -1), fed), fed)
            draft_out = None if rebuild is None else rebuild(batch, hidden, best)
            return StaticOutputs(hidden=hidden, logits=logits, best=best, draft_out=draft_out, staged=staged, packed=packed,
                                 masked=mask is not None)

        return self.graphs.run(_step_key(batch.num_seqs, batch.max_query_len, batch.max_context_len, rebuild,
                                         mask is not None), step)

    # ---- graphs ------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self, num_rows: int, q: int, width: int, rebuild: Rebuild | None = None, steps: int = 1,
                masked: bool = False) -> bool:
        """Captures the static step graph of (num_rows bucket, q tokens per row, context width) on a
        batch of padding rows only (they read and write only the scratch block and slot), so that no
        request pays for the capture; steps > 1: the multi-step decode graph (q = 1). False when there
        are no graphs or it is captured already."""
        Bp = bucket_size(num_rows)
        key = self._multi_key(Bp, steps, width, self._copies - 1) if steps > 1 else _step_key(Bp, q, width, rebuild, masked)
        if (not self.graphs.enabled or self.graphs.has(key) or not self.static_batch(Bp, q)
                or (masked and self.static_masks is None)):
            return False
        inp = self.inputs
        inp.wait_upload()
        inp.ensure(Bp * q, Bp, inp.max_blocks)
        lay = Layout(B=0, T=0, Bp=Bp, Tp=Bp * q, q_pad=q, width=inp.max_blocks, static=True)
        inp.tables(Bp, lay.width)[:] = 0
        inp.staging("query_start_loc", 1)[0] = 0
        pad_rows(inp, self.kv, self.ssm, 0, Bp, 0, q, True, lay.width)
        inp.upload()
        views = self._views(lay, Bp, lay.Tp, lay.Tp, [-1] * Bp, [q] * Bp, [False] * Bp, width)
        mask = self.static_masks.buffers(Bp * q) if masked else None
        if steps > 1:
            for parity in range(self._copies):  # a hybrid decoding ahead: two copies (run_multi)
                self._multi_step(views, steps, parity)
        else:
            self._static_step(views, rebuild, mask)
        torch.cuda.synchronize()  # the staging buffer is rewritten by the next capture or step
        return True

    def capture_prefills(self, progress: bool = False) -> int:
        """The prefill graphs of every shape (prefill_graph.py) -> how many were captured."""
        return self.prefills.capture(progress) if self.prefills is not None else 0

    def static_outputs(self, num_rows: int, q: int, width: int, rebuild: Rebuild | None = None) -> StaticOutputs | None:
        """The outputs of the captured step graph of that shape (None if not captured)."""
        return self.graphs.outputs(_step_key(bucket_size(num_rows), q, width, rebuild))

    def reserve_staged(self, shapes: list[tuple[int, int]], k: int) -> None:
        """Before a warm-up captures `shapes` (graph_shapes) at K = k: a hybrid's staged buffers at the
        largest step of each role (specialists/staged_states.py)."""
        if self.staged is not None:
            self.staged.reserve("step", max(b * (1 + min(k, self.max_drafts(b))) for b, _ in shapes))
            for parity in range(self._copies if self.decode_steps > 1 else 0):
                self.staged.reserve(("multi", parity), max(b * self.multi_steps(b) for b, _ in shapes))

    def graph_stats(self) -> dict:  # Engine.stats: the target's CUDA graphs, a hybrid's staged state buffers
        return {"graphs": len(self.graphs), "staged_state_mb": round(self.staged.nbytes / 2**20, 1) if self.staged else 0.0,
                "padded_prefills": self.prefills.steps if self.prefills is not None else 0,
                "padded_hit_prefills": self.prefills.hit_steps if self.prefills is not None else 0}

    def static_views(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device buffers a static batch of num_rows (padded) rows reads: its context lengths [Bp]
        and block tables [Bp, max_blocks] (what the last static step saw until the next build)."""
        inp = self.inputs
        return inp.device_view("context_lens", num_rows), inp.tables(num_rows, inp.max_blocks, device=True)
