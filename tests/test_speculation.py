"""Self-speculative decoding through the engine, on the four shipped specialists (float32, CPU).

Checked: greedy speculative output equals greedy non-speculative output token for token (K = 1, 2,
3, 5; alone and 8 concurrent; prefix cache on, with prompts that share prefixes); random acceptance
patterns (all accepted, all rejected, anything between) keep the KV and SSM invariants after every
step, and a committed SSM slot equals a fresh prefill of the committed tokens; drafts that span a
trigger never commit or emit past it (a crafted stop token, and the specialists' tool conversations);
a tool-call segment is decoded without speculation; per-request stats add up.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from policies.policy import SpeculationPolicy
from specialists.chat import render
from specialists.engine import Engine
from specialists.models.batch import ForwardBatch
from specialists.sampling import SamplingParams
from state.kv_cache import KVCache
from state.ssm_cache import SSMCache

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ["cpp", "python", "build", "shell"]
NEW = 20
DEV = os.environ.get("CANTATA_TEST_DEVICE", "cpu")  # "cuda" on a GPU machine: the same checks there


def _engine(domain: str, mode: str = "on", k: int = 3, **kw) -> Engine:
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("num_blocks", 512)
    policy = SpeculationPolicy(mode=mode, num_speculative_tokens=k)
    return Engine.from_pretrained(ROOT / "deploy" / "models" / domain, device=DEV, dtype=torch.float32,
                                  policy=policy, **kw)


def _prompts(engine: Engine, domain: str, n: int = 100, max_len: int = 80) -> list[list[int]]:
    rows = [json.loads(line) for line in (ROOT / "bench" / "data" / domain / "prompts.jsonl").read_text().splitlines()]
    out = []
    for r in rows:
        ids = engine.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"][-max_len:]
        if len(ids) >= 8:
            out.append(ids)
    shared = [out[i][:48] + out[i + 1][-24:] for i in range(0, 16, 2)]  # prefix-cache hits on out[0,2,..]
    return (out[: n - len(shared)] + shared)[:n]


def _drain(engine: Engine) -> None:
    assert not engine.has_unfinished()
    engine.kv.check_invariants()
    assert engine.kv.num_free_blocks() == engine.kv.pool.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("domain", DOMAINS)
def test_greedy_speculation_is_exact(domain: str) -> None:
    base = _engine(domain, mode="off")
    prompts = _prompts(base, domain)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    ref = [o.token_ids for o in base.generate(prompts, params)]
    for k in (1, 2, 3, 5):
        batched = _engine(domain, k=k)
        outs = batched.generate(prompts, params)
        assert [o.token_ids for o in outs] == ref, f"{domain} K={k} batched of 8"
        assert batched.totals.spec_steps > 0 and batched.totals.accepted > 0
        _drain(batched)
    for k in (1, 2, 3, 5):  # alone: one sequence at a time
        alone = _engine(domain, k=k, max_num_seqs=1)
        outs = alone.generate(prompts, params)
        assert [o.token_ids for o in outs] == ref, f"{domain} K={k} alone"
        _drain(alone)


def _tool_prompts(engine: Engine, domain: str, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in (ROOT / "bench" / "data" / domain / "tool_convs.jsonl").read_text().splitlines()]
    text = [render(r["messages"], r.get("tools"), add_generation_prompt=True) for r in rows[:n]]
    return [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in text]


@pytest.mark.slow
@pytest.mark.parametrize("domain", DOMAINS)
def test_tool_conversations_stop_at_the_trigger(domain: str) -> None:
    """With EOS and tool triggers live: same tokens and finish reasons as without speculation, nothing
    past a trigger, tool calls end with finish_reason tool_calls, and the segment ran unspeculated."""
    base = _engine(domain, mode="off")
    spec = _engine(domain, k=3)
    prompts = _tool_prompts(base, domain, 24)
    params = SamplingParams(max_tokens=96)
    ref = base.generate(prompts, params)
    outs = spec.generate(prompts, params)
    close = spec.triggers.tool_close_id
    opened = spec.triggers.tool_open_id
    n_calls = 0
    for r, o in zip(ref, outs):
        assert o.token_ids == r.token_ids and o.finish_reason == r.finish_reason
        if o.finish_reason == "tool_calls":
            n_calls += 1
            assert o.token_ids[-1] == close and o.token_ids.count(close) == 1
        if o.finish_reason == "stop":
            assert o.token_ids[-1] in spec.eos_ids
            assert not any(t in spec.eos_ids for t in o.token_ids[:-1])
        if opened in o.token_ids:  # the segment's tokens were emitted one per step
            events = [e for e, _ in o.stats.trigger_events]
            assert events[0] == "tool_open"
    assert n_calls >= len(prompts) // 2, f"{domain}: only {n_calls} tool calls"
    _drain(spec)


class _Oracle:
    """Drafts the reference continuation with a random number of leading correct tokens (0..k, so
    all-rejected and all-accepted steps both happen), the rest random wrong tokens."""

    def __init__(self, engine: Engine, refs: dict[str, list[int]], seed: int) -> None:
        self.engine, self.refs, self.rng = engine, refs, random.Random(seed)
        self.patterns: list[int] = []

    def __call__(self, seqs, kmax: int):
        vocab = self.engine.model.embed.shape[0]
        out = []
        for seq in seqs:
            ref = self.refs[seq.request_id]
            pos = len(seq.output_ids)
            good = self.rng.choice([0, kmax, self.rng.randint(0, kmax)])
            self.patterns.append(min(good, seq.spec_k))
            row = []
            for j in range(kmax):
                truth = ref[pos + j] if pos + j < len(ref) else 0
                row.append(truth if j < good else (truth + 1 + self.rng.randrange(vocab - 1)) % vocab)
            out.append(row)
        return torch.tensor(out, dtype=torch.int64, device=self.engine.device), [kmax] * len(out)

    def install(self) -> None:
        """Drafts through the oracle on both paths: the speculator's `_draft` (eager steps), and its
        `_draft_static` (static batches: CUDA graphs, or CANTATA_STATIC_BATCHES=1), whose rows are the
        plan's decodes, then padding."""
        spec = self.engine.speculator
        spec._draft = self

        def draft_static(plan):
            drafts = self([r.seq for r in plan.rows], plan.k)[0]
            return torch.cat([drafts, drafts.new_zeros(plan.static.rows - drafts.shape[0], plan.k)])

        spec._draft_static = draft_static


def _fresh_ssm(engine: Engine, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """conv and SSM state of every Mamba layer after a fresh prefill of `tokens` in scratch caches."""
    model = engine.model
    kv = KVCache(model.kv_cache_config(-(-len(tokens) // 16) + 1, 16, False))
    ssm = SSMCache(model.ssm_cache_config(1))
    slot = ssm.allocate()
    kv.add_sequence(0, tokens)
    kv.reserve(0, len(tokens))
    batch = ForwardBatch.from_kv(kv, [(0, tokens, True)], [slot], engine.device)
    model.forward(batch, kv, ssm)
    return [ssm.read(layer, [slot]) for layer in range(model.num_mamba_layers)]


@pytest.mark.parametrize("domain", ["cpp", "build"])  # Bamba hybrid, Llama
def test_random_acceptance_keeps_state_invariants(domain: str) -> None:
    base = _engine(domain, mode="off")
    prompts = _prompts(base, domain, n=5, max_len=40)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in base.generate(prompts, params)]
    engine = _engine(domain, k=4, max_num_seqs=5)
    rids = [engine.add_request(p, params) for p in prompts]
    oracle = _Oracle(engine, dict(zip(rids, ref)), seed=7)
    oracle.install()
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o.token_ids
        engine.kv.check_invariants()
        for seq in engine.scheduler.running:
            committed = seq.all_ids[:-1]
            assert engine.kv.num_computed(seq.seq_id) == len(committed)
            if engine.ssm is not None:
                want = _fresh_ssm(engine, committed)
                for layer, (conv, state) in enumerate(want):
                    got_conv, got_state = engine.ssm.read(layer, [seq.ssm_slot])
                    torch.testing.assert_close(got_conv, conv, atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(got_state, state, atol=1e-5, rtol=1e-5)
    assert [final[r] for r in rids] == ref
    assert 0 in oracle.patterns and 4 in oracle.patterns, oracle.patterns  # all rejected, all accepted
    _drain(engine)


def test_drafts_spanning_a_stop_token_are_cut() -> None:
    """Oracle drafts run through a stop token: the output ends at it, the KV never held past it."""
    base = _engine("build", mode="off")
    prompt = _prompts(base, "build", n=1)[0]
    ref = base.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids
    stop = next(t for i, t in enumerate(ref) if i >= 5 and t not in ref[:i])
    cut = ref.index(stop)
    engine = _engine("build", k=5)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop]))
    oracle = _Oracle(engine, {rid: ref}, seed=1)
    oracle.rng.choice = lambda seq: seq[1]  # always draft k correct tokens: runs span the trigger
    oracle.install()
    seen = 0
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o
        seq = engine._seqs.get(rid)
        if seq is not None:
            seen = max(seen, engine.kv.num_computed(seq.seq_id))
    assert out.token_ids == ref[: cut + 1] and out.finish_reason == "stop"
    assert seen <= len(prompt) + cut  # the stop token itself was never fed, nothing after it committed
    assert ("stop_token", cut) in out.stats.trigger_events
    _drain(engine)


def test_stats_add_up() -> None:
    engine = _engine("shell", k=3)
    prompts = _prompts(engine, "shell", n=4)
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    for o in outs:
        s = o.stats
        assert o.speculation == "on"
        assert s.emitted == 16 and s.drafted == sum(s.drafted_by_position)
        assert s.accepted == sum(s.accepted_by_position) <= s.drafted
        assert s.emitted == s.accepted + s.steps  # every step emits one target token plus its kept drafts
        assert s.ttft_s is not None and s.ttft_s >= 0
    t = engine.totals
    assert t.accepted == sum(o.stats.accepted for o in outs)
    _drain(engine)


def test_mode_off_never_drafts() -> None:
    engine = _engine("cpp", mode="off")
    outs = engine.generate(_prompts(engine, "cpp", n=3), SamplingParams(max_tokens=8, ignore_eos=True))
    assert all(o.speculation == "off" and o.stats.drafted == 0 for o in outs)
    assert engine.drafter is None


def test_abort_frees_a_running_and_a_waiting_request() -> None:
    engine = _engine("cpp", k=3, max_num_seqs=1)
    prompts = _prompts(engine, "cpp", n=2)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    running = engine.add_request(prompts[0], params)
    waiting = engine.add_request(prompts[1], params)
    engine.step()
    engine.step()
    assert engine.abort(waiting) and engine.abort(running)
    assert not engine.abort(running)  # already gone
    assert not engine.has_unfinished()
    _drain(engine)
    assert engine.ssm.num_free() == engine.cfg.max_num_seqs


def test_warmup_runs_decode_and_verify_shapes_and_restores_the_policy() -> None:
    engine = _engine("build", mode="auto", k=3)
    before = engine.gate.policy
    assert not engine.ready
    engine.warmup()
    assert engine.ready and engine.gate.policy == before
    assert engine.totals.spec_steps > 0  # the (K+1)-token verify ran
    # and the plain run: 2 * (K + 2) = 10 tokens one step each (prefill + 9 one-token decodes), plus
    # the speculative run's own prefill
    assert engine.totals.steps - engine.totals.spec_steps >= 2 * (3 + 2) + 1
    assert engine.gate.rolling_acceptance is None  # the warm-up's acceptance does not count
    _drain(engine)
