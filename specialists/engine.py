"""Engine: requests in, token streams out. Owns the scheduler, the runner, the KV and SSM caches.

  engine = Engine.from_pretrained("deploy/models/cpp")
  outs = engine.generate(["def main():"], SamplingParams(max_tokens=32))

One engine step: the scheduler picks prefills and decodes, the runner runs one forward, the sampler
picks one token per sequence, and the tokens come to the host in one copy; then KV and SSM state
are committed and finished sequences release their blocks and slots. No Ray in here.
Speculative decoding (draft, verify, accept, roll back) is the next issue and slots into `step`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from specialists.models.loader import load_model
from specialists.runner import Runner
from specialists.sampling import SamplingParams, sample
from specialists.scheduler import Scheduler, Sequence, Status
from state.kv_cache import KVCache
from state.ssm_cache import SSMCache

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot serve (empty or over-long prompt)."""


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | None while running
    finished: bool


@dataclass
class EngineConfig:
    max_num_seqs: int = 16
    max_model_len: int = 2048
    block_size: int = 16
    num_blocks: int | None = None  # default: room for max_num_seqs full-length sequences
    enable_prefix_cache: bool = True
    max_num_batched_tokens: int = 4096


class Engine:
    def __init__(self, model, tokenizer, cfg: EngineConfig, device: str | torch.device = "cpu") -> None:
        self.model, self.tokenizer, self.cfg, self.device = model, tokenizer, cfg, device
        hybrid = model.num_mamba_layers > 0
        if hybrid and cfg.enable_prefix_cache:
            log.info("prefix cache off: hybrid model (SSM state is not snapshotted per block yet)")
        num_blocks = cfg.num_blocks or cfg.max_num_seqs * -(-cfg.max_model_len // cfg.block_size)
        self.kv = KVCache(model.kv_cache_config(num_blocks, cfg.block_size, cfg.enable_prefix_cache and not hybrid))
        self.ssm = SSMCache(model.ssm_cache_config(cfg.max_num_seqs)) if hybrid else None
        self.scheduler = Scheduler(self.kv, self.ssm, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.runner = Runner(model, self.kv, self.ssm, device)
        self.eos_ids = {i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")) if i is not None}
        self._ids = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self._queues: dict[str, asyncio.Queue] = {}
        self._step_lock: asyncio.Lock | None = None
        self.steps = 0

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_num_seqs: int = 16,
        max_model_len: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        enable_prefix_cache: bool = True,
    ) -> "Engine":
        model = load_model(path, device=device, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        limit = min(model.config.max_position_embeddings, max_model_len or 2048)
        cfg = EngineConfig(max_num_seqs, limit, block_size, num_blocks, enable_prefix_cache)
        return cls(model, tokenizer, cfg, device)

    @property
    def stats(self) -> dict:
        return {"steps": self.steps, "preemptions": self.scheduler.num_preemptions,
                "prefix_hit_tokens": self.scheduler.prefix_hit_tokens,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting)}

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str:
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else list(prompt)
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
        self._seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        step = self.scheduler.schedule()
        if step.empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("no sequence could be scheduled: the KV cache is too small for the waiting requests")
            return []
        result = self.runner.run(step)
        seqs = [s for s, _ in step.prefills] + step.decodes
        tokens = sample(result.logits, [s.params for s in seqs], [s.generator for s in seqs]).tolist()  # the one host sync
        for seq, written in step.prefills:
            self.kv.commit(seq.seq_id, written, len(written))
        for seq in step.decodes:
            self.kv.commit(seq.seq_id, [seq.output_ids[-1]], 1)
        if self.ssm is not None and step.decodes:
            self.ssm.commit([s.ssm_slot for s in step.decodes], [1] * len(step.decodes))
        self.steps += 1
        outs = [self._append(seq, token) for seq, token in zip(seqs, tokens)]
        for out in outs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        return outs

    def _append(self, seq: Sequence, token: int) -> RequestOutput:
        p = seq.params
        seq.output_ids.append(token)
        reason = None
        visible = seq.output_ids
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason, visible = "stop", seq.output_ids[:-1]
        elif len(seq.output_ids) >= p.max_tokens or len(seq.all_ids) >= self.cfg.max_model_len:
            reason = "length"
        seq.text = self.tokenizer.decode(visible)
        if p.stop:
            hits = [i for i in (seq.text.find(s) for s in p.stop) if i >= 0]
            if hits:
                seq.text, reason = seq.text[: min(hits)], "stop"
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return self._output(seq)

    def _output(self, seq: Sequence) -> RequestOutput:
        finished = seq.status is Status.FINISHED
        if finished:
            self._seqs.pop(seq.request_id, None)
        return RequestOutput(seq.request_id, list(seq.prompt_ids), list(seq.output_ids), seq.text, seq.finish_reason, finished)

    # ---- front ends ----------------------------------------------------------------------------

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
