"""One engine step for a batch, in plain sight (the named data is in spec/step.py):

  plan     which rows run, how many drafts each wants, and whether the step is static (one shape:
           a CUDA graph on a GPU, the same code eagerly elsewhere)
  propose  the drafter's chains (or the ones it drafted ahead right after the last verify), on the device
  verify   one target forward over [last, d1..dk] per decode row (the runner places the drafts)
  accept   spec/acceptance.py: greedy rows by the target's argmax, sampled rows by rejection /
           typical; one packed layout (kept count, tokens, drafts) for every kind of step
  finish   the drafter's rebuild, then the step's one host copy (with drafting ahead queued behind it)
  commit   after the engine cut each run at its triggers: KV + SSM at exactly the kept tokens

  rows, out = speculator.execute(prefills, decodes, method, typical)   # plan .. finish, one host sync
  speculator.commit(rows, out, kept, rebuilt)

Per decode row with k drafts the target verifies [last, d1..dk]; acceptance keeps a drafts and adds
one target token, so the run is a+1 tokens. Committing r <= a+1 of them keeps the KV and SSM state of
[last, d1..d_{r-1}] (r tokens; the r-th run token is the next step's input) and rolls back the rest.
Prefill rows are runs of one sampled token. The drafter's entries for every token the target ran are
rebuilt from the target's hidden states before the sync, and each sequence's next chain starts from
the entry at its committed end. Independent of any one model: it drives a runner, a paged drafter and
the KV / SSM caches through their interfaces.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from tqdm import tqdm

from spec.acceptance import Method, TypicalParams, accept, greedy_accept, pack, unpack
from spec.catchup import CatchUp
from spec.decode_ahead import DecodeAhead, HostCopies
from spec.grammar import DraftMasks, StepMasks, active_guide, bitmask_words
from spec.mask_buffers import MaskBuffers
from spec.step import Accepted, AheadChain, Proposal, Row, StaticShape, StepOutput, StepPlan
from spec.verify_ahead import VerifyAhead
from state.transfer import device_ints


class Speculator:
    def __init__(self, runner: Any, kv: Any, ssm: Any | None, drafter: Any | None) -> None:
        self.runner, self.kv, self.ssm, self.drafter, self.device = runner, kv, ssm, drafter, runner.device
        self.vocab_size = runner.model.lm_head.shape[0]  # the logits' width: grammar masks cover it
        self._draft_out: torch.Tensor | None = None  # [T_prev, d] the last rebuild's entry outputs
        self._draft_index: dict[int, int] = {}  # seq_id -> row of _draft_out at its committed end
        self._carried: dict[int, int] = {}  # the same for sequences a step of prompts alone left waiting (_rebuild)
        # drafting ahead (static greedy steps): right after a verify the device drafts the next step from its own
        # acceptance; the next step uses those drafts if its sequences and committed lengths are the ones assumed.
        # The chain writes its entries past the accepted tokens: with the fused drafter the scheduler reserves room.
        self.ahead = drafter is not None and runner.static
        self.ahead_pool = self.ahead and drafter.chains_in_pool
        self._ahead: AheadChain | None = None
        self.copies = HostCopies()  # host copies of static steps' packed outputs (CUDA)
        self.decoding = DecodeAhead(runner, kv, self.copies)  # plain multi-step decodes launched ahead
        self.verifying = VerifyAhead(runner, kv, self.copies)  # greedy static verifies launched ahead
        self._ahead_wait: Callable[[], list] | None = None  # the host copy of a verify launched ahead, used this step
        self.ahead_used = self.ahead_missed = 0  # steps that used / could not use the drafts made ahead
        self.mask_kernel: Callable[..., None] | None = None  # a GPU's grammar masks (ops/grammar_mask); None: torch ops
        self._mask_buffers = MaskBuffers(self.device)
        self.catch_up = CatchUp()  # drafter entries owed for plain steps that skipped the rebuild
        self._entries: set[int] = set()  # sequences the drafter has entries for (rebuilt at least once)

    def owed(self, seq_id: int) -> int:
        """Tokens whose drafter entries the next rebuild of seq_id will catch up (spec/catchup.py)."""
        return self.catch_up.owed(seq_id, self.kv.num_computed)

    def settle(self, running: list) -> bool:
        """Before the scheduler: keeps a step launched ahead (a plain decode or a verify) if it is the step
        the host would build now, else discards it. -> kept (then the step admits nobody)."""
        if self.decoding.settle(running):
            return True
        kept, restore = self.verifying.settle(running)
        if restore is not None:  # the step before's drafter outputs, which the discarded step overwrote
            self._draft_out = restore
        return kept

    def forget(self, seq_id: int) -> None:
        self._draft_index.pop(seq_id, None)
        self._entries.discard(seq_id)
        self.catch_up.forget(seq_id)

    def execute(
        self,
        prefills: list[tuple[Any, list[int]]],  # (sequence, tokens to prefill)
        decodes: list[Any],  # sequences; seq.spec_k drafts each (0 = plain decode)
        method: Method = "greedy",  # acceptance for sampled requests: rejection | typical (greedy rows are exact)
        typical: TypicalParams = TypicalParams(),
        rebuild: bool = True,  # run the drafter's rebuild (False when speculation is off for good)
        owe_new: bool = False,  # without the rebuild: new prompts' entries owed too (the gate's fallback)
    ) -> tuple[list[Row], StepOutput]:
        t0 = time.perf_counter()
        plan = self.plan(prefills, decodes, method, typical, rebuild, owe_new)
        proposal = self.propose(plan)
        t1 = time.perf_counter()
        forward = self.verify(plan, proposal)
        out = self.finish(plan, forward, self.accept(plan, proposal, forward))
        out.draft_s, out.verify_s = t1 - t0, time.perf_counter() - t1
        out.mask_s = plan.masks.mask_s if plan.masks is not None else 0.0
        return plan.rows, out

    # ---- plan -> propose -> verify -> accept -> finish ------------------------------------------

    def plan(self, prefills: list[tuple[Any, list[int]]], decodes: list[Any], method: Method,
             typical: TypicalParams, rebuild: bool, owe_new: bool = False) -> StepPlan:
        drafting = self.drafter is not None
        want = [seq.spec_k if drafting and seq.draft_ok else 0 for seq in decodes]
        rows = [Row(seq, True, list(toks)) for seq, toks in prefills]
        rows += [Row(seq, False, [seq.output_ids[-1]], k) for seq, k in zip(decodes, want)]
        plan = StepPlan(rows, k=max(want, default=0), method=method, typical=typical, rebuild=rebuild,
                        greedy=all(r.seq.params.greedy for r in rows), owe_new=owe_new and not rebuild)
        guided = {b: g for b, g in enumerate(active_guide(r.seq) for r in rows) if g is not None}
        if guided:  # grammar masks: filled on the host as the chain goes, applied before acceptance
            plan.masks = StepMasks(self.vocab_size, plan.k, guided, self.device,
                                   {b: rows[b].seq.params.max_tokens - len(rows[b].seq.output_ids) for b in guided},
                                   kernel=self.mask_kernel, buffers=self._mask_buffers)
        kmax = plan.k  # rows without drafts beside speculating ones verify kmax unkept (limits; scheduler.plan_drafts)
        padded = kmax > 0 and all(w == kmax or s.pad_k >= kmax for s, w in zip(decodes, want))  # pad_k: KV reserved
        if (not prefills and decodes and (len(set(want)) == 1 or padded) and self.runner.static_batch(len(decodes), 1 + kmax)
                and (not drafting or self.drafter.min_confidence == 0)):
            plan.limits = want if len(set(want)) > 1 else None
            committed = [self.kv.num_computed(s.seq_id) for s in decodes]
            # decode_steps > 1: greedy rows without drafts (specialists/multistep.py: one graph, one sync for
            # `steps` tokens a row); never under a grammar (each token's mask depends on the one before)
            steps = 1 if guided else min(seq.decode_steps for seq in decodes)
            if steps > 1:
                plan.multi = steps
            plan.static = StaticShape(*self.runner.static_shape(len(decodes), max(committed) + max(1 + kmax, steps)),
                                      committed)
        return plan

    def propose(self, plan: StepPlan) -> Proposal:
        """The drafts each row verifies; settles the plan's layout (an eager chain may stop early)."""
        ahead, self._ahead = self._ahead, None  # drafts made ahead apply to the very next step only
        if plan.static is not None:
            plan.settle([plan.k] * len(plan.rows))
            if plan.k == 0:
                return Proposal(None)
            if plan.masks is not None:  # drafts under the grammar: the eager chain; the verify stays static
                return self._guided_static(plan)
            if ahead is not None and ahead.matches(plan):
                self.ahead_used += 1
                return Proposal(ahead.drafts, ahead=True)
            self.ahead_missed += ahead is not None
            return Proposal(self._draft_static(plan))
        spec = [i for i, r in enumerate(plan.rows) if r.k > 0]
        num = [0] * len(plan.rows)
        drafts = None
        if spec:  # the drafter may stop a chain early (low confidence, a draft the grammar refuses), which sets k
            seqs = [plan.rows[i].seq for i in spec]
            if plan.masks is None:
                drafts, counts = self._draft(seqs, plan.k)  # [S, kd], [S]
            else:
                drafts, counts = self._draft(seqs, plan.k, DraftMasks(plan.masks, spec, plan.k, self.drafter.vocab, self.device))
            for i, n in zip(spec, counts):
                num[i] = min(plan.rows[i].k, n)
        plan.settle(num)
        if drafts is None or plan.k == 0:
            return Proposal(None)
        drafts = drafts[:, :plan.k]
        if len(spec) < len(plan.rows):  # batch row order: rows that do not draft get zeros (never read)
            full = torch.zeros(len(plan.rows), plan.k, dtype=torch.int64, device=self.device)
            full[device_ints(spec, self.device)] = drafts
            drafts = full
        return Proposal(drafts)

    def _guided_static(self, plan: StepPlan) -> Proposal:
        """A static step with guided rows: the drafter's eager chain under the grammar's masks, padded to
        the plan's k; a row whose chain stopped early verifies only its own drafts (plan.limits)."""
        seqs = [r.seq for r in plan.rows]
        guide = DraftMasks(plan.masks, list(range(len(seqs))), plan.k, self.drafter.vocab, self.device)
        if self.drafter.chains_in_pool:  # the fused chain: a graph per depth, masked on the device
            drafts, counts = self.drafter.chain_guided(*self._static_chain_inputs(plan), guide)
        else:
            drafts, counts = self._draft(seqs, plan.k, guide)
        plan.limits = [min(lim, n) for lim, n in zip(plan.limits or [plan.k] * len(counts), counts)]
        if drafts.shape[1] < plan.k:
            drafts = torch.cat([drafts, drafts.new_zeros(drafts.shape[0], plan.k - drafts.shape[1])], dim=1)
        return Proposal(drafts[:, :plan.k])

    def verify(self, plan: StepPlan, proposal: Proposal) -> Any:
        """The target's forward over the plan with the proposal's drafts (a static greedy step: with
        its acceptance and the drafter's rebuild in the graph) -> the runner's StepResult."""
        if plan.multi > 1:
            return self.decoding.forward(plan)  # tokens [Bp, S], packed [Bp, 2S] (or the step decoded ahead)
        taken = self.verifying.take(plan)
        if taken is not None:  # launched ahead by the step before (spec/verify_ahead.py)
            res, self._ahead_wait = taken
            return res
        in_graph = self._rebuild_in_graph(plan)
        masks = None
        if plan.masks is not None and plan.static is not None and getattr(self.runner, "static_masks", None) is not None:
            t0 = time.perf_counter()  # a GPU's guided static step: the masks go into the step's graph
            plan.masks.fill_first()
            out = self.runner.static_masks.host(plan.static.rows * (plan.k + 1))  # written in place: no host copy
            words, closers = plan.masks.words([1 + r.k for r in plan.rows], out)
            masks = (words, None if closers is None else self._mask_buffers.bonus(closers))
            plan.masks.mask_s += time.perf_counter() - t0
        return self.runner.run(plan.rows, proposal.drafts, rebuild=self.drafter.rebuild if in_graph else None,
                               static=plan.static is not None or plan.masks is None, masks=masks)

    def accept(self, plan: StepPlan, proposal: Proposal, res: Any) -> Accepted:
        """Each row's kept drafts and target token (spec/acceptance.py), packed for the host; on the device."""
        B = len(plan.rows)
        if plan.multi > 1:  # every token of the multi-step decode is kept (the engine cuts the runs)
            return Accepted(res.tokens, res.packed)
        masked = res.static is not None and res.static.masked  # the graph applied the grammars' masks
        if res.static is not None and plan.greedy and (plan.masks is None or masked):  # the graph accepted and packed its rows
            return Accepted(res.static.best[:B * (plan.k + 1)].view(B, plan.k + 1), res.static.packed[:B])
        drafts = None if proposal.drafts is None else proposal.drafts[:B]
        if plan.masks is not None and not masked:  # each guided row's logits keep only what its grammar allows there
            t0 = time.perf_counter()
            plan.masks.fill_first()
            plan.masks.apply(res.logits, [1 if r.prefill else 1 + r.k for r in plan.rows])
            plan.masks.mask_s += time.perf_counter() - t0
        lidx = self._logits_rows(plan)
        if plan.greedy:  # the target's argmax after each position; exact
            best = res.logits.argmax(-1)  # [rows of logits]
            argmax = best.view(B, plan.k + 1) if lidx is None else best[lidx]  # [B, k+1]
            limited = lidx is not None or plan.limits is not None
            result = greedy_accept(argmax, drafts, None if not limited or drafts is None else self._num_drafts(plan))
        else:
            target = res.logits.view(B, plan.k + 1, -1) if lidx is None else res.logits[lidx]  # [B, k+1, V]
            fed = drafts if drafts is not None else torch.zeros(B, 0, dtype=torch.int64, device=self.device)
            result = accept(target, fed, self._num_drafts(plan), [r.seq.params for r in plan.rows], [plan.method] * B,
                            [r.seq.generator for r in plan.rows], typical=plan.typical)
        return Accepted(result.tokens, pack(result, drafts))

    def finish(self, plan: StepPlan, forward: Any, accepted: Accepted) -> StepOutput:
        """The drafter's rebuild, then the step's one host sync; a greedy static step drafts the next
        step's chain on the device behind the copy."""
        if plan.multi > 1:  # runs of `multi` tokens; the fed ones (all but the last) are what commit keeps
            return self.decoding.finish(plan, forward)
        static, rebuild_s, catchup_s = forward.static, 0.0, 0.0
        if self._rebuild_in_graph(plan):
            self._draft_out = static.draft_out
        elif plan.rebuild and self.drafter is not None:
            t0 = time.perf_counter()
            self.catch_up.run(self.runner, self.drafter, [r.seq_id for r in plan.rows], self.kv.num_computed)  # owed first
            catchup_s = time.perf_counter() - t0
            self._rebuild(plan, forward, accepted.tokens)
            rebuild_s = time.perf_counter() - t0
        elif self.drafter is not None and not self.runner.static and (self._entries or plan.owe_new or self.catch_up.owes):
            self.catch_up.stash(plan.rows, self._entries, plan.owe_new, forward.hidden, accepted.tokens,
                                lambda: self._next_tokens(plan, forward, accepted.tokens), self.kv.num_computed)
        ahead = self.ahead and plan.k > 0 and self._rebuild_in_graph(plan) and plan.masks is None
        wait, self._ahead_wait = self._ahead_wait, None  # this step was launched ahead: its copy is queued
        drafts_next = None
        if ahead:  # the one sync waits for the copy, not for the chain and the verify launched after it
            wait = wait or self.copies.start(accepted.packed)
            drafts_next = self._chain_ahead(plan, static)
            self.verifying.launch(plan, static, drafts_next, static.draft_out, self.drafter.rebuild)
        host = wait() if wait else accepted.packed.tolist()  # the step's one host sync (pageable: faster for a few words)
        runs, drafts = unpack(host, [r.k for r in plan.rows], plan.k)
        if plan.limits is not None:  # a guided chain that stopped early, padded rows: the graph's acceptance did not know
            runs = [run[:lim + 1] for run, lim in zip(runs, plan.limits)]
            for r, lim in zip(plan.rows, plan.limits):  # the drafts it could keep (the engine's counts), not the layout's
                r.k = min(r.k, lim)
        if ahead:  # valid next step if every run is committed whole and the same sequences decode
            self._ahead = AheadChain([r.seq_id for r in plan.rows],
                                     [c + len(run) for c, run in zip(plan.static.committed, runs)], plan.k, drafts_next)
            self.verifying.assume(self._ahead.committed)
        return StepOutput(runs, drafts, rebuild_s=rebuild_s, catchup_s=catchup_s)

    # ---- the parts -----------------------------------------------------------------------------

    def _rebuild_in_graph(self, plan: StepPlan) -> bool:
        """A greedy static step's rebuild runs in the verify's graph (next tokens: the argmaxes)."""
        return plan.static is not None and plan.rebuild and plan.greedy and self.drafter is not None

    def _chain_ahead(self, plan: StepPlan, static: Any) -> torch.Tensor:
        """The next step's drafts [Bp, k], drafted on the device from this verify's graph outputs."""
        ctx, tables = self.runner.static_views(plan.static.rows)
        return self.drafter.chain_ahead(static.draft_out, static.packed, ctx, tables, plan.k, plan.static.width)

    def _num_drafts(self, plan: StepPlan) -> torch.Tensor:  # [B] int64
        return device_ints(plan.limits if plan.limits is not None else [r.k for r in plan.rows], self.device)  # no sync: the step's copy stays its only one

    def _logits_rows(self, plan: StepPlan) -> torch.Tensor | None:
        """[B, k+1] logits row of each row's positions (a row with fewer repeats its last one, ignored);
        None when every row has k+1 of them in order (the usual case: no padding needed)."""
        counts = [1 if r.prefill else 1 + r.k for r in plan.rows]
        if all(m == plan.k + 1 for m in counts):
            return None
        lidx, n = [], 0
        for m in counts:
            lidx.append([n + min(j, m - 1) for j in range(plan.k + 1)])
            n += m
        return device_ints(lidx, self.device)

    def _draft(self, seqs: list[Any], kmax: int, guide: DraftMasks | None = None) -> tuple[torch.Tensor, list[int]]:
        """An eager chain: -> drafts [S, k] (k <= kmax) and how many each sequence should verify (host)."""
        dev = self.device
        prev = self._draft_out[device_ints([self._draft_index[s.seq_id] for s in seqs], dev)]
        committed = [self.kv.num_computed(s.seq_id) for s in seqs]
        tables_host = [self.kv.block_table(s.seq_id) for s in seqs]
        width = max(len(tb) for tb in tables_host)
        tables = device_ints([tb + [0] * (width - len(tb)) for tb in tables_host], dev, torch.int32)
        return self.drafter.chain(prev, committed, tables, kmax, guide)

    def _draft_static(self, plan: StepPlan) -> torch.Tensor:
        """A static chain (a CUDA graph on a GPU): -> drafts [Bp, k], padding rows after the real ones."""
        return self.drafter.chain_static(*self._static_chain_inputs(plan))

    def _static_chain_inputs(self, plan: StepPlan) -> tuple:
        """A static chain's arguments: the entries, each row's last one, its committed length and block
        table, then k, the batch bucket and the context width."""
        ids = [r.seq_id for r in plan.rows]
        st = plan.static
        return (self._draft_out, [self._draft_index[i] for i in ids], st.committed, [self.kv.block_table(i) for i in ids],
                plan.k, st.rows, st.width)

    def _rebuild(self, plan: StepPlan, res: Any, tokens: torch.Tensor) -> None:
        """Drafter entries for every token of the batch: (its hidden, the token after it). A step of
        prompts alone while others wait (specialists/scheduler.prefill_alone) keeps the waiting ones'
        last outputs after its own, so that their next chains start where they left off."""
        out = self.drafter.rebuild(res.batch, res.hidden, self._next_tokens(plan, res, tokens))
        wait: list[int] = []
        if all(r.prefill for r in plan.rows):  # prompts alone: the sequences not in the step wait
            here = {r.seq_id for r in plan.rows}
            wait = [s for s in self._draft_index if s not in here]
        if wait and self._draft_out is not None:
            rows = device_ints([self._draft_index[s] for s in wait], self.device)
            self._carried = {s: out.shape[0] + i for i, s in enumerate(wait)}
            out = torch.cat([out, self._draft_out[rows].to(out.dtype)])
        self._draft_out = out

    def _next_tokens(self, plan: StepPlan, res: Any, tokens: torch.Tensor) -> torch.Tensor:
        """[T]: the token after each token of the batch (a prompt shifted by one, then the sampled one;
        a verify's kept drafts and the target's token)."""
        T, kmax = res.hidden.shape[0], plan.k
        if kmax == 0 and not plan.rows[0].prefill:  # plain decodes only (prefills come first): the sampled tokens
            return tokens.reshape(-1)
        src: list[int] = []
        for b, r in enumerate(plan.rows):
            base = T + b * (kmax + 1)
            if r.prefill:
                src.extend(range(r.t0 + 1, r.t0 + r.q))  # the prompt shifted by one
                src.append(base)  # then the sampled token
            else:
                src.extend(range(base, base + r.q))  # kept drafts and the target's token
        if src == list(range(T, T + tokens.numel())):  # decodes only, every row at kmax drafts: all of tokens
            return tokens.reshape(-1)
        pool = torch.cat([res.batch.input_ids, tokens.reshape(-1)])
        return pool[device_ints(src, self.device)]

    # ---- graphs and host bookkeeping -----------------------------------------------------------

    def capture_graphs(self, k: int, rebuild: bool, max_rows: int, progress: bool = False) -> int:
        """Captures the graphs static steps replay, for every batch bucket up to max_rows and every
        context width: the 1-token decode always, the (k+1)-token verify, the chain and the chain
        drafted ahead when k > 0, with the drafter's rebuild when `rebuild`. -> how many (0 without graphs)."""
        if not self.runner.graphs.enabled:
            return 0
        post = self.drafter.rebuild if rebuild and self.drafter is not None else None
        n = 0
        masked = getattr(self.runner, "static_masks", None) is not None  # guided steps: their own graphs
        shapes = self.runner.graph_shapes(max_rows)
        self.runner.reserve_staged(shapes, k)
        for b, w in tqdm(shapes, desc="CUDA graphs", unit="shape", disable=not progress):
            kb = min(k, self.runner.max_drafts(b))  # the K a step of this bucket verifies (Engine.step)
            n += self.runner.capture(b, 1, w, post)
            if masked:
                n += self.runner.capture(b, 1, w, post, masked=True) + (self.runner.capture(b, 1 + kb, w, post, masked=True) if kb else 0)
            if self.runner.multi_steps(b) > 1:  # specialists/multistep.py: plain steps, and auto's fallback steps
                n += self.runner.capture(b, 1, w, steps=self.runner.multi_steps(b))
            if kb:
                n += self.runner.capture(b, 1 + kb, w, post)
                n += self.drafter.capture_chain(b, kb, w)
                if self.mask_kernel is not None:  # the drafter's chain under a grammar, a graph per depth
                    n += self.drafter.capture_guided(b, kb, w, bitmask_words(self.vocab_size))
                outputs = self.runner.static_outputs(b, 1 + kb, w, post)
                if self.ahead and post is not None and outputs is not None:
                    ctx, tables = self.runner.static_views(b)
                    n += self.drafter.capture_chain_ahead(outputs.draft_out, outputs.packed, ctx, tables, kb, w)
        return n

    def commit(self, rows: list[Row], out: StepOutput, kept: list[int], rebuilt: bool) -> None:
        """Keeps `kept[b]` run tokens of row b (1 <= kept <= len(run), or 0 for a finished row that
        commits nothing more): KV and SSM state of exactly the committed tokens, the rest rolled back."""
        slots, counts = [], []
        self._draft_index, self._carried = (dict(self._carried) if rebuilt else {}), {}
        for r, drafts, m in zip(rows, out.drafts, kept):
            if r.prefill:
                self.kv.commit(r.seq_id, r.tokens, len(r.tokens))
                end = r.t0 + len(r.tokens) - 1
            else:
                m = max(m, 1)  # the fed token is always committed (it was emitted last step)
                hold = self.decoding.holds(r.seq_id) or self.verifying.holds(r.seq_id)
                self.kv.commit(r.seq_id, r.tokens + drafts, m, hold=hold)
                if self.ssm is not None:
                    slots.append(r.ssm_slot)
                    counts.append(m)
                end = r.t0 + m - 1
            if rebuilt:
                self._draft_index[r.seq_id] = end
                self._entries.add(r.seq_id)
        if self.ssm is not None and slots:
            self.ssm.commit(slots, counts)
