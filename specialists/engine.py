"""Engine: requests in, token streams out. Owns the scheduler, the runner, the KV and SSM caches.

  engine = Engine.from_pretrained("deploy/models/cpp")               # options by keyword, or
  engine = Engine.from_pretrained(path, EngineOptions(device="cuda"))  # specialists/options.py
  outs = engine.generate(["def main():"], SamplingParams(max_tokens=32))

One engine step: the scheduler picks prefills and decodes, the speculator plans, proposes, verifies
and accepts (spec/speculator.py; one host copy), the engine cuts each run at its triggers, KV and SSM
state are committed, finished sequences release their blocks and slots. No Ray in here.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from dataclasses import replace
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from policies.gate import HELD_EVERY, SETTLE_STEPS, SpeculationGate
from policies.policy import SpeculationPolicy
from spec.acceptance import TypicalParams
from spec.speculator import Speculator
from spec.stats import SpecStats, StepTimes
from spec.step import StepOutput
from specialists.base_checkpoint import resolve_weights
from specialists.drafter import PagedDrafter
from specialists.guided import Grammars, commit_grammars, mask_kernel, serving_hints
from specialists.models.draftvocab import read_draft_vocab
from specialists.models.loader import load_model
from specialists.models.mtp import MissingDrafterError, MTPDrafter, load_drafter
from specialists.options import EngineConfig, EngineOptions
from specialists.outputs import RequestError, RequestOutput, cut_run, merge_status, prompt_ids, trigger_tokens
from specialists import detok, quantize
from specialists.runner import Runner
from specialists.sampling import SamplingParams
from specialists.wire import GrammarSpec
from specialists.scheduler import Scheduler, Sequence, Status
from state.kv_cache import KVCache
from state.ssm_cache import SSMCache
from state.ssm_snapshots import SSMSnapshots, pool_shape

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model, tokenizer, cfg: EngineConfig, *, drafter: MTPDrafter | None = None,
                 policy: SpeculationPolicy | None = None, draft_vocab: torch.Tensor | None = None,
                 grammar_bounds: dict | None = None) -> None:
        """`cfg`: resolved options (EngineOptions.resolve); `drafter`: the checkpoint's MTP drafter (None:
        no speculation); `draft_vocab`: [N] token ids the drafter may propose (None: all);
        `grammar_bounds`: specialists/grammar.Bounds' fields for constrained decoding."""
        self.model, self.tokenizer, self.cfg, self.device = model, tokenizer, cfg, cfg.device
        hybrid = model.num_mamba_layers > 0
        self.ssm = SSMCache(model.ssm_cache_config(cfg.max_num_seqs)) if hybrid else None
        snaps, stride = pool_shape(self.ssm.config, cfg.num_blocks, cfg.block_size, cfg.ssm_snapshots, cfg.ssm_snapshot_stride) \
            if hybrid and cfg.enable_prefix_cache else (0, 0)  # a hybrid's prefix hits need its Mamba state (ssm_snapshots.py)
        prefix = cfg.enable_prefix_cache and (not hybrid or snaps > 0)
        self.kv = KVCache(model.kv_cache_config(cfg.num_blocks, cfg.block_size, prefix))
        self.snapshots = SSMSnapshots(self.ssm, self.kv, snaps, stride) if hybrid and prefix else None
        cfg = replace(cfg, ssm_snapshot_stride=stride if self.snapshots is not None else 0)  # 0: none (the runner's padded prefills)
        self.scheduler = Scheduler(self.kv, self.ssm, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.scheduler.snapshots = self.snapshots
        cfg, self.quantized = quantize.apply(model, cfg)  # "auto" resolved; weights with an int8 copy
        self.cfg = cfg
        self.runner = Runner(model, self.kv, self.ssm, cfg)
        self.drafter = None if drafter is None else PagedDrafter(
            drafter, model.embed, model.lm_head, num_blocks=cfg.num_blocks, block_size=cfg.block_size, vocab=draft_vocab,
            min_confidence=cfg.draft_min_confidence, cuda_graphs=cfg.cuda_graphs,
            max_positions=self.runner.max_context_width + 64, fused=cfg.fused_drafter)
        if policy is None:
            policy = SpeculationPolicy() if drafter is not None else SpeculationPolicy(mode="off")
        if drafter is None and policy.mode != "off":
            raise MissingDrafterError("speculation needs an MTP drafter; pass one or use mode 'off'")
        self.gate = SpeculationGate(policy, paired=not self.runner.static)  # multi-step graphs: block baselines
        self.scheduler.mark_drafts(self.drafter.copy_block if self.drafter is not None and prefix else None)
        self.speculator = Speculator(self.runner, self.kv, self.ssm, self.drafter)
        self.speculator.mask_kernel = mask_kernel(cfg.fused_drafter, self.runner.device)  # a GPU's grammar masks
        self.scheduler.draft_lookahead, self.scheduler.prefill_alone = self.speculator.ahead_pool, self.runner.lone_prefill
        if cfg.decode_ahead:  # spec/decode_ahead.py, spec/verify_ahead.py (attention-only models)
            self.speculator.decoding.allowed = self._may_go_ahead
        if cfg.verify_ahead and not hybrid:
            self.speculator.verifying.allowed = functools.partial(self._may_go_ahead, verify=True)
        self.eos_ids, self.triggers = trigger_tokens(tokenizer)  # EOS ids; the tool call's open and close tokens
        self.totals, self.step_times = SpecStats(), StepTimes()
        self._ids = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self._queues: dict[str, asyncio.Queue] = {}
        self._step_lock: asyncio.Lock | None = None
        self.ready, self.steps, self._settle = False, 0, 0  # _settle: steps until step times are judged again (after a prefill)
        self._grammars = Grammars(tokenizer, self.speculator.vocab_size, self.eos_ids, grammar_bounds)

    @classmethod
    def from_pretrained(cls, path: str | Path, options: EngineOptions | None = None, *,
                        policy: SpeculationPolicy | None = None, **kw) -> "Engine":
        """An engine over a checkpoint directory. `options` (specialists/options.py), or its fields as
        keywords (Engine.from_pretrained(path, device="cuda", max_num_seqs=8)); both: the keywords win.
        `policy` None: speculation in the default policy when the checkpoint has a drafter, off
        otherwise; asking for speculation without a drafter raises MissingDrafterError. A directory
        with a base.json has its weights imported (specialists/base_checkpoint.py), its drafter beside."""
        opts, weights = EngineOptions.from_keywords(options, **kw), resolve_weights(path)
        model = load_model(weights, device=opts.device, dtype=opts.dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(weights))
        cfg = opts.resolve(model.config.max_position_embeddings, model.config.hidden_size)
        drafter = None
        if opts.load_mtp and (policy is None or policy.mode != "off"):
            try:
                drafter = load_drafter(Path(path), device=opts.device, dtype=opts.dtype)
            except MissingDrafterError:
                if policy is not None:
                    raise
                log.warning("%s has no MTP drafter: speculation off", path)
        size = opts.draft_vocab_size
        vocab = read_draft_vocab(Path(path), size) if drafter is not None and size != 0 else None
        bounds = opts.grammar_bounds if opts.grammar_bounds is not None else serving_hints(Path(path)).get("grammar_bounds")
        return cls(model, tokenizer, cfg, drafter=drafter, policy=policy, draft_vocab=vocab, grammar_bounds=bounds)

    def grammar(self, spec):  # noqa: ANN001, ANN201 - GrammarSpec -> Constraint (specialists/grammar.py)
        """A request's grammar compiled for this engine's tokenizer (cached per spec), to pass as
        SamplingParams.grammar. Slow on a cache miss: call it off the engine thread. Raises
        specialists.grammar.GrammarError for a grammar that cannot be compiled."""
        return self._grammars.compile(spec)

    def set_policy(self, policy: SpeculationPolicy) -> None:
        """Switch the speculation policy live (takes effect at the next step)."""
        if self.drafter is None and policy.mode != "off":
            raise MissingDrafterError("this engine has no MTP drafter: only mode 'off' is possible")
        self.gate.set_policy(policy)

    def warmup(self) -> None:
        """CUDA graphs (on a GPU), then the prefill, 1-token decode and (with a drafter) (K+1)-token verify once each; ready after. The policy in force is restored, its window fresh."""
        self.capture_graphs(progress=True)
        policy = self.gate.policy
        ids = [self.tokenizer.convert_tokens_to_ids("<|im_start|>")] * 4
        params = SamplingParams(max_tokens=2 * (policy.num_speculative_tokens + 2), ignore_eos=True)
        modes = ["off"] + (["on"] if self.drafter is not None else [])
        try:
            for mode in modes:
                self.gate.set_policy(policy.model_copy(update={"mode": mode}))
                self.generate([ids], params)
                if self.speculator.mask_kernel is not None:  # its kernels compile now, not in a request
                    self.generate([ids], replace(params, ignore_eos=False, grammar=self.grammar(GrammarSpec(kind="json_object"))))
        finally:
            self.gate.set_policy(policy, fresh=True)  # the warm-up's acceptance and times do not count
        self.ready = True

    def capture_graphs(self, max_rows: int | None = None, progress: bool = False) -> int:
        """CUDA graphs of the policy's steps (every batch bucket up to max_rows, default max_num_seqs, every context width),
        the speculative ones under mode off too (a switch is live; a graph captured in use cost a step 3-13 ms), the largest
        K first (a hybrid's staged buffers: Runner.reserve_staged), and a fresh prompt's prefills. -> how many (0 on CPU)."""
        policy, spec = self.gate.policy, self.drafter is not None
        ks = sorted({policy.num_speculative_tokens, *(policy.auto.k_choices if policy.mode == "auto" else ())}, reverse=True) if spec else [0]
        return sum(self.speculator.capture_graphs(k, spec, max_rows or self.cfg.max_num_seqs, progress) for k in ks) + self.runner.capture_prefills(progress)

    def metrics(self) -> dict:
        return {**self.stats, **self.totals.as_dict(), **self._grammars.stats(), "gate": self.gate.snapshot(), "step_times": self.step_times.as_dict()}

    @property
    def stats(self) -> dict:
        return {"steps": self.steps, "preemptions": self.scheduler.num_preemptions,
                "prefix_hit_tokens": self.scheduler.prefix_hit_tokens, "decode_ahead": self.speculator.decoding.stats(),
                "verify_ahead": self.speculator.verifying.stats(),
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                # CUDA graphs captured so far (target and drafter): one captured while serving stalls its step ~5-20 ms
                "graph_captures": self.runner.graphs.captures + (self.drafter.graphs.captures if self.drafter is not None else 0),
                **self.runner.graph_stats(), **(self.snapshots.stats() if self.snapshots is not None else {})}

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str:
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else prompt_ids(prompt, self.speculator.vocab_size)
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= self.cfg.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; this model takes at most {self.cfg.max_model_len - 1}")
        if not self.kv.can_allocate(len(ids) + 1):
            raise RequestError(f"the prompt has {len(ids)} tokens, more than the KV cache can ever hold")
        rid = request_id or uuid.uuid4().hex
        gen = None
        if not params.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        seq = Sequence(next(self._ids), rid, ids, params, generator=gen)
        seq.stats.arrival_time = time.monotonic()
        seq.stats.prompt_tokens = len(ids)
        seq.in_tool = self.triggers.open_segment(ids)
        if params.grammar is not None:  # a tool call's grammar starts at once when the prompt opened the call
            seq.guide = params.grammar.new_guide(seq.in_tool, params.max_tokens)
        self._seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> bool:
        """Drops a request (a client that went away): its blocks and slot are freed now. Call it from
        the thread that runs `step`. False when the request is unknown or already finished."""
        seq = self._seqs.pop(request_id, None)
        if seq is None or seq.status is Status.FINISHED:
            return False
        if seq.status is Status.WAITING:
            self.scheduler.abort_waiting(seq)
        else:
            self.scheduler.finish(seq, "abort")
            self.speculator.forget(seq.seq_id)
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(self._output(seq))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine step: gate, schedule, draft, verify, accept, cut at triggers, commit, emit."""
        sched = self.scheduler
        t_step = time.perf_counter()
        batch = min(len(sched.running) + len(sched.waiting), sched.max_num_seqs)  # the step's, prefills admitted
        guided = sched.guided()  # the gate judges steps with a grammar apart
        status = self.gate.decide(batch, guided) if self.drafter is not None else "off"
        decided = f"fallback:{self.gate.reason}" if status == "fallback" else status
        policy = self.gate.policy
        rebuild = self.drafter is not None and policy.mode != "off" and status != "fallback"  # owed entries: caught up
        multi = self.runner.multi_steps(batch) if not rebuild and self.runner.static else 1
        k = min(self.gate.k_for(batch, guided), self.runner.max_drafts(batch)) if status == "on" else 0  # exact rows
        sched.plan_drafts(k, multi, self.runner.static, self.cfg.max_model_len)
        ahead = self.speculator.settle(sched.running)  # a step launched ahead runs these rows: no admission
        step = sched.schedule(speculating=status == "on", admit=not ahead)
        if step.empty:
            if sched.has_unfinished():
                raise RuntimeError("no sequence could be scheduled: the KV cache is too small for the waiting requests")
            return []
        now = time.monotonic()
        for seq in (seq for seq, _ in step.prefills if seq.stats.first_scheduled_time is None):
            seq.stats.first_scheduled_time = now
        typical = TypicalParams(policy.typical.epsilon, policy.typical.delta)
        if self.snapshots is not None:  # a hybrid's prefills keep their states at block boundaries
            self.snapshots.plan(step.prefills)
        rows, out = self.speculator.execute(step.prefills, step.decodes, policy.acceptance, typical, rebuild, status == "fallback")
        t0 = time.perf_counter()
        kept, events = self._cut_runs(rows, out, status)
        for i in commit_grammars(rows, out.runs, kept, out.mask_s, self.totals):  # a grammar with no way on
            events[i] = "grammar_error"
        pending = self.snapshots.capture(rows, kept) if self.snapshots is not None else []
        self.speculator.commit(rows, out, kept, rebuild)  # KV and SSM at exactly the kept tokens
        for row in rows:  # before _emit: a sequence that finishes marks its blocks by drafted_all
            sched.drafter_wrote(row.seq, rebuild)
        if pending:  # the committed blocks' entries exist now
            self.snapshots.store(pending)
        outs = [self._emit(row.seq, run[:n], event) for row, run, n, event in zip(rows, out.runs, kept, events)]
        t_commit = time.perf_counter() - t0
        for row in rows:
            row.seq.stats.add_times(out.draft_s, out.verify_s, t_commit)
            if row.seq.status is Status.FINISHED:
                self.speculator.forget(row.seq.seq_id)
        self._time_step(status, bool(step.prefills), rows, out, sum(kept), guided, t_step)
        self.totals.add_times(out.draft_s, out.verify_s, t_commit)
        self.step_times.add(decided, time.perf_counter() - t_step, sum(kept))
        if self.cfg.check_invariants:
            self._check_invariants()
        self.steps += 1
        for o in outs:
            queue = self._queues.get(o.request_id)
            if queue is not None:
                queue.put_nowait(o)
        return outs

    def _time_step(self, status: str, prefills: bool, rows: list, out: StepOutput, tokens: int, guided: bool, t: float) -> None:
        """To the gate: settled decode-only steps' time per token (not an "on" step without drafts, catching up;
        a resume's catch-up is a one-off, left out), and a speculating prefill's drafter pass (CPU: wall time)."""
        self._settle = SETTLE_STEPS if prefills and self.gate.paired else max(0, self._settle - 1)
        if status == "on" and prefills and self.gate.paired:
            self.gate.charge(len(rows), max(0.0, out.rebuild_s - out.catchup_s), guided)
        timed = not (prefills or self._settle) and (self.steps % HELD_EVERY == 0 or not (status == "fallback" and self.gate.holding))
        if status != "off" and timed and (status != "on" or any(row.k for row in rows)):
            seconds = time.perf_counter() - t - out.catchup_s
            self.gate.observe_time(status, len(rows), seconds, tokens, max(r.k for r in rows), guided)

    def _may_go_ahead(self, rows: list, steps: int, verify: bool = False) -> bool:
        """Whether the step after this one (`steps` tokens a row: a plain decode's, or a verify's) may be
        launched before this one's outputs are read: nobody waits to be admitted, speculation is off for a
        plain step (or `auto` holds it off: a switch back discards the step ahead) and on for a verify,
        every row has room for it (a verify ahead: and its chain) and some row goes on past this step."""
        on = self.drafter is not None and self.gate.status == "on"
        return (not self.scheduler.waiting and on == verify
                and all(self.cfg.max_model_len - r.seq.num_tokens - 1 >= (3 if verify else 2) * steps - 1 for r in rows)
                and any(r.seq.params.max_tokens - len(r.seq.output_ids) > steps for r in rows))

    def _cut_runs(self, rows: list, out, status: str) -> tuple[list[int], list[str | None]]:
        """Each run cut at its triggers (-> tokens kept, the event that cut it), and the step's
        speculation counted: drafts that could be emitted (not those past max_tokens), kept after the cut."""
        kept: list[int] = []
        events: list[str | None] = []
        drafted = accepted = 0
        for row, run in zip(rows, out.runs):
            seq = row.seq
            n, event = cut_run(self.triggers, self.tokenizer, self.cfg.max_model_len, seq, run)
            kept.append(n)
            events.append(event)
            k_room = max(0, min(row.k, seq.params.max_tokens - len(seq.output_ids) - 1))
            a = min(len(run) - 1, n - 1) if k_room else 0
            drafted += k_room
            accepted += a
            seq.stats.record(k_room, a, n)
            seq.stats.note_k(row.k)
            self.totals.record(k_room, a, n)
            if not row.prefill:
                seq.stats.speculation = merge_status(seq.stats.speculation, status if seq.draft_ok or status == "fallback" else "off")
        if drafted:
            self.gate.observe(drafted, accepted)
        return kept, events

    def _check_invariants(self) -> None:
        for seq in self.scheduler.running:
            if self.kv.num_computed(seq.seq_id) != seq.num_tokens - 1:
                raise AssertionError(f"seq {seq.seq_id}: KV pointer {self.kv.num_computed(seq.seq_id)} != committed {seq.num_tokens - 1}")

    def _emit(self, seq: Sequence, run: list[int], event: str | None) -> RequestOutput:
        p = seq.params
        if seq.stats.first_token_time is None:
            seq.stats.first_token_time = time.monotonic()
        seq.emit(run)
        reason = None
        visible = seq.output_ids
        if event is not None:
            seq.stats.trigger_events.append((event, len(seq.output_ids) - 1))
        if event in ("eos", "stop_token"):
            reason, visible = "stop", seq.output_ids[:-1]
        elif event in ("tool_close", "grammar_error"):
            reason = "tool_calls" if event == "tool_close" else event
        elif event == "tool_open":
            seq.in_tool = True
            if seq.guide is not None:  # tool_choice auto: the call's grammar starts after <tool_call>
                seq.guide.tool_opened()
        if reason is None and (len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.cfg.max_model_len):
            reason = "length"
        seq.text = detok.text_of(self.tokenizer, seq, visible)  # = tokenizer.decode(visible), incrementally
        if event == "stop_string" or (p.stop and reason is None):
            hits = [i for i in (seq.text.find(s) for s in p.stop) if i >= 0]
            if hits:
                seq.text, reason = seq.text[: min(hits)], "stop"
        if reason is not None:
            seq.stats.finished_time = time.monotonic()
            self.scheduler.finish(seq, reason)
        return self._output(seq)

    def _output(self, seq: Sequence) -> RequestOutput:
        finished = seq.status is Status.FINISHED
        if finished:
            self._seqs.pop(seq.request_id, None)
        return RequestOutput(request_id=seq.request_id, prompt_token_ids=list(seq.prompt_ids),
                             token_ids=list(seq.output_ids), text=seq.text, finish_reason=seq.finish_reason,
                             finished=finished, speculation=seq.stats.speculation, stats=seq.stats)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams], use_tqdm: bool = False) -> list[RequestOutput]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(rids), desc="generate", unit="req", disable=not use_tqdm)
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [final[r] for r in rids]

    async def stream(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """RequestOutput snapshots as tokens arrive (the last one finished). Concurrent streams share
        engine steps: whoever finds its queue empty runs the next step."""
        if self._step_lock is None:
            self._step_lock = asyncio.Lock()
        rid = self.add_request(prompt, params, request_id)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        try:
            while True:
                while queue.empty():
                    async with self._step_lock:
                        if queue.empty():
                            self.step()
                    await asyncio.sleep(0)
                out = queue.get_nowait()
                yield out
                if out.finished:
                    return
        finally:
            self._queues.pop(rid, None)
