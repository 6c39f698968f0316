"""One engine step for a batch: draft -> verify -> accept -> (the engine cuts at triggers) -> commit /
roll back. Independent of any one model: it drives a runner (target forward over paged KV), a paged
drafter and the KV / SSM caches through their interfaces.

  rows, out = speculator.execute(prefills, decodes, method, typical)   # device work, one host sync
  kept = [engine cuts each run at its first trigger / stop / max_tokens]
  speculator.commit(rows, kept)                                       # KV + SSM at exactly `kept`

Per decode row with k drafts the target verifies [last, d1..dk]; acceptance keeps a drafts and adds
one target token, so the run is a+1 tokens. Committing r <= a+1 of them keeps the KV and SSM state of
[last, d1..d_{r-1}] (r tokens; the r-th run token is the next step's input) and rolls back the rest.
Prefill rows are runs of one sampled token. The drafter's entries for every token the target ran are
rebuilt from the target's hidden states before the sync, and each sequence's next chain starts from
the entry at its committed end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from spec.acceptance import TypicalParams, accept


@dataclass
class Row:
    seq: Any  # specialists.scheduler.Sequence: seq_id, ssm_slot, output_ids, params, generator, spec_k
    prefill: bool
    tokens: list[int]  # the new tokens fed this step (prefill) or [last] + k placeholders
    k: int  # drafts verified (0 for prefills and plain decodes)
    t0: int  # flat index of the row's first token in the batch


@dataclass
class StepOutput:
    runs: list[list[int]]  # [B] kept drafts + the target's token, before trigger truncation
    draft_s: float = 0.0
    verify_s: float = 0.0
    drafts: list[list[int]] = field(default_factory=list)  # [B] the verified drafts (host), for commit


class Speculator:
    def __init__(self, runner: Any, kv: Any, ssm: Any | None, drafter: Any | None) -> None:
        self.runner, self.kv, self.ssm, self.drafter = runner, kv, ssm, drafter
        self.device = runner.device
        self._draft_out: torch.Tensor | None = None  # [T_prev, d] the last rebuild's entry outputs
        self._draft_index: dict[int, int] = {}  # seq_id -> row of _draft_out at its committed end
        # drafting ahead (static greedy steps): right after a verify the device drafts the next step from
        # its own acceptance, while the host commits; the next step uses those drafts if its sequences
        # and their committed lengths are the ones assumed. The chain then writes its chained entries
        # past the accepted tokens: with the fused drafter the scheduler reserves room for them.
        self.ahead = drafter is not None and runner.static
        self.ahead_pool = self.ahead and drafter.chains_in_pool
        self._next: tuple | None = None  # (seq ids, committed lengths, k, drafts [Bp, k]) drafted ahead
        self._pinned: torch.Tensor | None = None  # host copy of a static step's packed output (CUDA)
        self._done: Any = None  # torch.cuda.Event: that copy is done
        self.ahead_used = self.ahead_missed = 0  # steps that used / could not use the drafts made ahead

    def forget(self, seq_id: int) -> None:
        self._draft_index.pop(seq_id, None)

    # ---- device work -------------------------------------------------------------------------

    def execute(
        self,
        prefills: list[tuple[Any, list[int]]],  # (sequence, tokens to prefill)
        decodes: list[Any],  # sequences; seq.spec_k drafts each (0 = plain decode)
        method: str = "greedy",  # acceptance for sampled requests: rejection | typical (greedy rows are exact)
        typical: TypicalParams = TypicalParams(),
        rebuild: bool = True,  # run the drafter's rebuild (False when speculation is off for good)
    ) -> tuple[list[Row], StepOutput]:
        dev = self.device
        t_draft = time.perf_counter()
        want = {id(seq): (seq.spec_k if self.drafter is not None and seq.draft_ok else 0) for seq in decodes}
        ks = set(want.values())
        if not prefills and len(ks) == 1 and self.runner.static_batch(len(decodes), 1 + min(ks)) and (
                self.drafter is None or self.drafter.min_confidence == 0):
            return self._execute_static(decodes, ks.pop(), method, typical, rebuild, t_draft)
        self._next = None  # a mixed step: whatever was drafted ahead no longer applies
        spec_seqs = [seq for seq in decodes if want[id(seq)] > 0]
        drafts = None
        if spec_seqs:  # draft first: the drafter may stop a chain early (low confidence), which sets k
            drafts, counts = self._draft(spec_seqs, max(want[id(s)] for s in spec_seqs))  # [S, kd], [S]
            for seq, n in zip(spec_seqs, counts):
                want[id(seq)] = min(want[id(seq)], n)
        rows: list[Row] = []
        t = 0
        for seq, toks in prefills:
            rows.append(Row(seq, True, list(toks), 0, t))
            t += len(toks)
        for seq in decodes:
            k = want[id(seq)]
            rows.append(Row(seq, False, [seq.output_ids[-1]] + [0] * k, k, t))
            t += 1 + k
        kmax = max((r.k for r in rows), default=0)
        if kmax == 0:
            drafts = None
        fill = None
        if drafts is not None:
            drafts = drafts[:, :kmax]
            spec_set = {id(s) for s in spec_seqs}
            spec_rows = [r for r in rows if not r.prefill and id(r.seq) in spec_set]
            idx, src = [], []
            for i, r in enumerate(spec_rows):
                idx.extend(range(r.t0 + 1, r.t0 + 1 + r.k))
                src.extend(range(i * kmax, i * kmax + r.k))
            if idx:
                full = len(src) == drafts.numel()  # every draft is verified: no selection needed
                fill = (torch.tensor(idx, dtype=torch.int64, device=dev),
                        drafts.reshape(-1) if full else drafts.reshape(-1)[torch.tensor(src, device=dev)])
        t_verify = time.perf_counter()

        res = self.runner.run([(r.seq.seq_id, r.tokens, r.prefill, r.seq.ssm_slot) for r in rows], fill)
        B = len(rows)
        params = [r.seq.params for r in rows]
        # logits rows per batch row: 1 for a prefill, 1 + k for a decode; padded to kmax + 1 below
        counts = [1 if r.prefill else 1 + r.k for r in rows]
        uniform = all(m == kmax + 1 for m in counts)  # the usual case: rows of one shape, no padding needed
        lidx = None
        if not uniform:  # row j of a row with fewer logits rows repeats its last one (ignored)
            lidx, n = [], 0
            for m in counts:
                lidx.append([n + min(j, m - 1) for j in range(kmax + 1)])
                n += m
            lidx = torch.tensor(lidx, device=dev)
        draft_tokens = None
        if drafts is not None:
            if len(spec_rows) == B:  # every row speculates: the drafts are already in row order
                draft_tokens = drafts
            else:
                draft_tokens = torch.zeros(B, kmax, dtype=torch.int64, device=dev)
                spec_pos = torch.tensor([i for i, r in enumerate(rows) if id(r.seq) in spec_set and not r.prefill], device=dev)
                draft_tokens[spec_pos] = drafts

        greedy = all(p.greedy for p in params)
        if greedy:
            # the target's argmax after each position; kept drafts equal it, so a row's run is its
            # first a+1 entries, a = the leading drafts that match (counted on the host after the sync)
            best = res.logits.argmax(-1)  # [rows of logits]
            tokens = best.view(B, kmax + 1) if lidx is None else best[lidx]  # [B, kmax+1]
            packed = tokens
        else:
            target = res.logits.view(B, kmax + 1, -1) if lidx is None else res.logits[lidx]  # [B, kmax+1, V]
            tokens, packed = self._accept(rows, target, draft_tokens, method, typical)

        if rebuild and self.drafter is not None:
            self._rebuild(rows, res, tokens, kmax)
        if draft_tokens is not None:
            packed = torch.cat([packed, draft_tokens], dim=1)
        host = packed.tolist()  # the one host sync of the step
        t_end = time.perf_counter()
        runs, dlist = self._runs(rows, host, greedy, kmax, draft_tokens is not None)
        return rows, StepOutput(runs, t_verify - t_draft, t_end - t_verify, dlist)

    def _execute_static(self, decodes: list[Any], k: int, method: str, typical: TypicalParams, rebuild: bool,
                        t_draft: float) -> tuple[list[Row], StepOutput]:
        """`execute` for a static batch (every row a decode with k drafts; CUDA graphs on a GPU):
        the chain, and the verify with its argmax (and a greedy step's rebuild), each one graph."""
        B, q = len(decodes), 1 + k
        committed = [self.kv.num_computed(s.seq_id) for s in decodes]
        Bp, width = self.runner.static_shape(B, max(committed) + q)  # the verify's rows and attention width
        ids = [s.seq_id for s in decodes]
        drafts, ahead, self._next = None, self._next, None
        if k and ahead is not None and ahead[:3] == (ids, committed, k):  # drafted ahead, on what happened
            drafts = ahead[3]
            self.ahead_used += 1
        elif k:
            self.ahead_missed += ahead is not None
            drafts = self.drafter.chain_static(self._draft_out, [self._draft_index[i] for i in ids], committed,
                                               [self.kv.block_table(i) for i in ids], k, Bp, width)
        rows = [Row(seq, False, [seq.output_ids[-1]] + [0] * k, k, b * q) for b, seq in enumerate(decodes)]
        t_verify = time.perf_counter()
        params = [r.seq.params for r in rows]
        greedy = all(p.greedy for p in params)
        in_graph = rebuild and greedy and self.drafter is not None  # the rebuild's next tokens are the argmaxes
        res = self.runner.run([(r.seq.seq_id, r.tokens, False, r.seq.ssm_slot) for r in rows], fill_rows=drafts,
                              rebuild=self.drafter.rebuild if in_graph else None)
        if greedy:  # the graph packed the argmaxes with the drafts it was fed
            tokens, packed = res.best.view(B, q), res.packed[:B]
        else:
            tokens, packed = self._accept(rows, res.logits.view(B, q, -1), None if drafts is None else drafts[:B],
                                          method, typical)
            if drafts is not None:
                packed = torch.cat([packed, drafts[:B]], dim=1)
        if in_graph:
            self._draft_out = res.draft_out
        elif rebuild and self.drafter is not None:
            self._rebuild(rows, res, tokens, k)
        ahead = self.ahead and in_graph and k > 0
        if ahead and packed.is_cuda:  # the step's one sync waits for the copy, not for the chain after it
            host = self._host_copy(packed)
            drafts_next = self._chain_ahead(res, Bp, k, width)
            host = host()
        else:
            host = packed.tolist()  # the one host sync of the step
            drafts_next = self._chain_ahead(res, Bp, k, width) if ahead else None
        runs, dlist = self._runs(rows, host, greedy, k, drafts is not None)
        if ahead:  # valid next step if every run is committed whole and the same sequences decode
            self._next = (ids, [c + len(run) for c, run in zip(committed, runs)], k, drafts_next)
        return rows, StepOutput(runs, t_verify - t_draft, time.perf_counter() - t_verify, dlist)

    def _chain_ahead(self, res: Any, Bp: int, k: int, width: int) -> torch.Tensor:
        """The next step's drafts [Bp, k], drafted on the device from this verify's outputs."""
        ctx, tables = self.runner.static_views(Bp)
        return self.drafter.chain_ahead(res.draft_out, res.packed, ctx, tables, k, width)

    def _host_copy(self, packed: torch.Tensor):
        """Starts packed's copy into pinned host memory; -> a call that waits for it and returns the lists."""
        n = packed.numel()
        if self._pinned is None or self._pinned.numel() < n:
            self._pinned = torch.empty(max(n, 4096), dtype=torch.int64, pin_memory=True)
        dst = self._pinned[:n].view(packed.shape)
        dst.copy_(packed, non_blocking=True)
        if self._done is None:
            self._done = torch.cuda.Event()
        done = self._done
        done.record()
        return lambda: (done.synchronize(), dst.tolist())[1]

    def _accept(self, rows: list[Row], target: torch.Tensor, drafts: torch.Tensor | None, method: str,
                typical: TypicalParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled rows: target [B, kmax+1, V], drafts [B, kmax] (None: no row drafted) -> (tokens
        [B, kmax+1], the step's packed output [B, 1 + kmax+1] with each row's kept count first)."""
        B, kmax = target.shape[0], target.shape[1] - 1
        num_drafts = torch.tensor([r.k for r in rows], dtype=torch.int64, device=self.device)
        if drafts is None:
            drafts = torch.zeros(B, kmax, dtype=torch.int64, device=self.device)
        result = accept(target, drafts, num_drafts, [r.seq.params for r in rows], [method] * B,
                        [r.seq.generator for r in rows], typical=typical)
        return result.tokens, torch.cat([result.num_accepted[:, None], result.tokens], dim=1)

    def capture_graphs(self, k: int, rebuild: bool, max_rows: int, progress: bool = False) -> int:
        """Captures the graphs `_execute_static` replays, for every batch bucket up to max_rows and
        every context width: the 1-token decode always, the (k+1)-token verify and the chain when k > 0,
        with the drafter's rebuild when `rebuild`. Returns how many were captured (0 without graphs)."""
        if not self.runner.graphs.enabled:
            return 0
        post = self.drafter.rebuild if rebuild and self.drafter is not None else None
        shapes = [(b, w) for b in self.runner.graph_buckets(max_rows) for w in self.runner.context_widths()]
        n = 0
        for b, w in tqdm(shapes, desc="CUDA graphs", unit="shape", disable=not progress):
            n += self.runner.capture(b, 1, w, post)
            if k:
                n += self.runner.capture(b, 1 + k, w, post)
                n += self.drafter.capture_chain(b, k, w)
                outputs = self.runner.static_outputs(b, 1 + k, w, post)
                if self.ahead and post is not None and outputs is not None:  # the chain drafted ahead
                    ctx, tables = self.runner.static_views(b)
                    n += self.drafter.capture_chain_ahead(outputs[3], outputs[5], ctx, tables, k, w)
        return n

    @staticmethod
    def _runs(rows: list[Row], host: list[list[int]], greedy: bool, kmax: int, drafted: bool):
        """The step's host copy -> (runs, verified drafts) per row: a greedy row's kept drafts are
        the leading ones equal to the target's argmax; a sampled row carries its count first."""
        runs, dlist = [], []
        off = 0 if greedy else 1  # greedy rows carry no accepted count
        for r, h in zip(rows, host):
            d = h[off + kmax + 1 : off + kmax + 1 + r.k] if drafted else []
            if greedy:
                a = 0
                while a < r.k and d[a] == h[a]:
                    a += 1
            else:
                a = h[0]
            runs.append(h[off : off + a + 1])
            dlist.append(d)
        return runs, dlist

    def _draft(self, seqs: list[Any], kmax: int) -> tuple[torch.Tensor, list[int]]:
        """-> drafts [S, k] (k <= kmax) and how many of them each sequence should verify (host)."""
        dev = self.device
        prev = self._draft_out[torch.tensor([self._draft_index[s.seq_id] for s in seqs], device=dev)]
        committed = [self.kv.num_computed(s.seq_id) for s in seqs]
        tables_host = [self.kv.block_table(s.seq_id) for s in seqs]
        width = max(len(tb) for tb in tables_host)
        tables = torch.tensor([tb + [0] * (width - len(tb)) for tb in tables_host], dtype=torch.int32, device=dev)
        drafts, counts = self.drafter.chain(prev, committed, tables, kmax)
        return drafts, counts

    def _rebuild(self, rows: list[Row], res: Any, tokens: torch.Tensor, kmax: int) -> None:
        """Drafter entries for every token of the batch: (its hidden, the token after it)."""
        T = res.hidden.shape[0]
        src: list[int] = []
        for b, r in enumerate(rows):
            n = len(r.tokens)
            base = T + b * (kmax + 1)
            if r.prefill:
                src.extend(range(r.t0 + 1, r.t0 + n))  # the prompt shifted by one
                src.append(base)  # then the sampled token
            else:
                src.extend(range(base, base + n))  # kept drafts and the target's token
        if src == list(range(T, T + tokens.numel())):  # decodes only, every row at kmax drafts: all of tokens
            next_tokens = tokens.reshape(-1)
        else:
            pool = torch.cat([res.batch.input_ids, tokens.reshape(-1)])
            next_tokens = pool[torch.tensor(src, dtype=torch.int64, device=self.device)]
        self._draft_out = self.drafter.rebuild(res.batch, res.hidden, next_tokens)

    # ---- host bookkeeping --------------------------------------------------------------------

    def commit(self, rows: list[Row], out: StepOutput, kept: list[int], rebuilt: bool) -> None:
        """Keeps `kept[b]` run tokens of row b (1 <= kept <= len(run), or 0 for a finished row that
        commits nothing more): KV and SSM state of exactly the committed tokens, the rest rolled back."""
        slots, counts = [], []
        self._draft_index.clear()
        for r, run, drafts, m in zip(rows, out.runs, out.drafts, kept):
            sid = r.seq.seq_id
            if r.prefill:
                self.kv.commit(sid, r.tokens, len(r.tokens))
                end = r.t0 + len(r.tokens) - 1
            else:
                written = [r.tokens[0]] + (drafts if r.k else [])
                m = max(m, 1)  # the fed token is always committed (it was emitted last step)
                self.kv.commit(sid, written, m)
                if self.ssm is not None:
                    slots.append(r.seq.ssm_slot)
                    counts.append(m)
                end = r.t0 + m - 1
            if rebuilt:
                self._draft_index[sid] = end
        if self.ssm is not None and slots:
            self.ssm.commit(slots, counts)
