"""The engine on the shipped build (Llama) and cpp (Bamba hybrid) specialists, float32 on CPU.

Checked: greedy output equals transformers' generate(do_sample=False) token for token; a sequence's
greedy output does not depend on what it is batched with (prefix cache on and off); prefix-cache
hits are counted and change nothing; preemption by recompute changes nothing; finish reasons
(length, stop string, stop token, EOS); seeded sampling is reproducible; streaming ends where
generate ends. After every test the KV pool is whole again and its invariants hold.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specialists.engine import Engine, RequestOutput
from specialists.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["build", "cpp"]  # Llama, Bamba (Mamba2 hybrid)
NEW = 32




# ---- engines, and the after-every-test pool check ---------------------------------------------------


class Engines:
    """Engines by (domain, options), built once per module; `fresh` builds one for a single test.
    Every engine a test touched is checked after it: nothing running, every block back in the pool."""

    def __init__(self) -> None:
        self._cache: dict[tuple, Engine] = {}
        self.touched: list[Engine] = []

    def get(self, domain: str, fresh: bool = False, **kw) -> Engine:
        kw.setdefault("num_blocks", 256)
        kw.setdefault("max_num_seqs", 16)
        key = (domain, tuple(sorted(kw.items())))
        if fresh or key not in self._cache:
            eng = Engine.from_pretrained(ROOT / "deploy" / "models" / domain, device="cpu", dtype=torch.float32, **kw)
            if fresh:
                self.touched.append(eng)
                return eng
            self._cache[key] = eng
        eng = self._cache[key]
        self.touched.append(eng)
        return eng


@pytest.fixture(scope="module")
def _engine_cache() -> Engines:
    return Engines()


@pytest.fixture
def engines(_engine_cache: Engines):
    _engine_cache.touched = []
    yield _engine_cache
    for eng in _engine_cache.touched:
        assert not eng.has_unfinished()
        total = eng.kv.cfg.num_blocks
        assert eng.kv.num_free_blocks() == total, f"{total - eng.kv.num_free_blocks()} of {total} blocks still held"
        assert eng.kv.sequence_ids() == []
        eng.kv.check_invariants()
        if eng.ssm is not None:
            assert eng.ssm.num_free() == eng.cfg.max_num_seqs


# ---- prompts and the transformers reference -----------------------------------------------------------


def prompt_ids(domain: str, tok, n: int, length: int, skip: int = 0) -> list[list[int]]:
    """The last `length` tokens of the first n prompts (after `skip`) that have that many."""
    out: list[list[int]] = []
    seen = 0
    for line in (ROOT / "bench" / "data" / domain / "prompts.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        ids = tok(json.loads(line)["prompt"], add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            seen += 1
            if seen > skip:
                out.append(ids[-length:])
        if len(out) == n:
            return out
    raise AssertionError(f"{domain}: fewer than {n} prompts of {length} tokens")


@pytest.fixture(scope="module")
def hf_models() -> dict:
    cache: dict = {}

    def get(domain: str):
        if domain not in cache:
            hf = AutoModelForCausalLM.from_pretrained(ROOT / "deploy" / "models" / domain, dtype=torch.float32,
                                                      attn_implementation="eager").eval()
            hf.generation_config.eos_token_id = None  # ignore EOS without masking it
            cache[domain] = hf
        return cache[domain]

    return get


@torch.no_grad()
def hf_greedy(hf, prompts: list[list[int]], new: int):
    """One unpadded batch of equal-length prompts -> (new tokens per prompt, per-step scores)."""
    ids = torch.tensor(prompts)
    g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                    pad_token_id=hf.config.pad_token_id, output_scores=True, return_dict_in_generate=True)
    return [row.tolist() for row in g.sequences[:, ids.shape[1]:]], g.scores


def greedy(n: int = NEW, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None if len(a) == len(b) else min(len(a), len(b)))


# ---- exactness ----------------------------------------------------------------------------------


@pytest.mark.parametrize("domain", MODELS)
def test_greedy_matches_transformers(domain: str, engines, hf_models) -> None:
    eng = engines.get(domain)
    prompts = prompt_ids(domain, eng.tokenizer, 4, 64)
    outs = eng.generate(prompts, greedy())
    ref, scores = hf_greedy(hf_models(domain), prompts, NEW)
    bad = []
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.finished and o.finish_reason == "length" and len(o.token_ids) == NEW
        assert o.prompt_token_ids == prompts[i]
        j = first_diff(o.token_ids, r)
        if j is not None:
            top2 = scores[j][i].topk(2).values
            bad.append(f"prompt {i}: first divergence at new token {j} (engine {o.token_ids[j]}, transformers {r[j]}, "
                       f"transformers top-2 logit gap {(top2[0] - top2[1]).item():.2e})")
    assert not bad, "\n".join(bad)


BATCH_CASES = [("build", True), ("build", False), ("cpp", True)]


@pytest.mark.parametrize("domain,prefix_cache", BATCH_CASES, ids=["build-prefix", "build-noprefix", "cpp"])
def test_batched_equals_alone(domain: str, prefix_cache: bool, engines) -> None:
    eng = engines.get(domain, enable_prefix_cache=prefix_cache)
    tok = eng.tokenizer
    target = prompt_ids(domain, tok, 1, 64, skip=4)[0]
    others = [p[-n:] for p, n in zip(prompt_ids(domain, tok, 7, 64, skip=5), (17, 64, 33, 50, 5, 64, 41))]
    others.append(target[:32] + others[0][:20])  # shares two full blocks with the target: a prefix-cache hit
    alone = eng.generate([target], greedy(24))[0]
    hits_before = eng.stats["prefix_hit_tokens"]
    batch = others[:4] + [target] + others[4:]
    outs = eng.generate(batch, greedy(24))
    assert outs[4].token_ids == alone.token_ids, f"diverges at new token {first_diff(outs[4].token_ids, alone.token_ids)}"
    assert outs[4].text == alone.text
    if prefix_cache and domain == "build":  # the target ran before: its prompt blocks are now cache hits
        assert eng.stats["prefix_hit_tokens"] > hits_before
    # and every other sequence equals itself alone too
    for p, o in zip(batch, outs):
        assert o.token_ids == eng.generate([p], greedy(24))[0].token_ids


def test_prefix_cache_hits_change_nothing(engines) -> None:
    cached = engines.get("build", fresh=True, enable_prefix_cache=True)
    plain = engines.get("build", enable_prefix_cache=False)
    tok = cached.tokenizer
    a, b = prompt_ids("build", tok, 2, 64, skip=12)
    p1, p2 = a[:48] + a[48:], a[:48] + b[-16:]  # 48 shared tokens = 3 full blocks of 16
    assert p1 != p2
    o1 = cached.generate([p1], greedy())[0]
    hits = cached.stats["prefix_hit_tokens"]
    o2 = cached.generate([p2], greedy())[0]
    assert cached.stats["prefix_hit_tokens"] - hits == 48
    r1, r2 = plain.generate([p1, p2], greedy())
    assert plain.stats["prefix_hit_tokens"] == 0
    assert o1.token_ids == r1.token_ids and o2.token_ids == r2.token_ids
    # concurrent: both at once in a cache that already holds the prefix
    c1, c2 = cached.generate([p2, p1], greedy())
    assert c1.token_ids == r2.token_ids and c2.token_ids == r1.token_ids


@pytest.mark.parametrize("domain,prefix_cache", BATCH_CASES, ids=["build-prefix", "build-noprefix", "cpp"])
def test_preemption_by_recompute(domain: str, prefix_cache: bool, engines) -> None:
    # 64-token prompts + 48 new = 7 blocks of 16 per sequence; 10 blocks hold two prompts but not two
    # finished sequences, so running sequences must be preempted and recomputed (from their own cached
    # blocks when the prefix cache is on, from scratch when it is off)
    small = engines.get(domain, fresh=True, num_blocks=10, max_num_seqs=6, enable_prefix_cache=prefix_cache)
    big = engines.get(domain)
    prompts = prompt_ids(domain, small.tokenizer, 6, 64, skip=2)
    got = small.generate(prompts, greedy(48))
    want = big.generate(prompts, greedy(48))
    assert small.stats["preemptions"] > 0, small.stats
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids, f"prompt {i}: diverges at new token {first_diff(g.token_ids, w.token_ids)}"
        assert g.finish_reason == "length" and len(g.token_ids) == 48


def test_prompt_ids_that_are_not_the_models_are_refused_alone(engines) -> None:
    """A prompt of token ids is a list of ints in the vocabulary: anything else (a tokenizer's output
    object, an id past the embedding) is the request's RequestError, and the engine goes on serving."""
    from specialists.outputs import RequestError

    eng = engines.get("build")
    ok = prompt_ids("build", eng.tokenizer, 1, 32)[0]
    with pytest.raises(RequestError, match="list of token ids, not BatchEncoding"):
        eng.add_request(eng.tokenizer("make all"), greedy(4))
    with pytest.raises(RequestError, match="outside this model's vocabulary"):
        eng.add_request(ok[:-1] + [eng.speculator.vocab_size], greedy(4))
    with pytest.raises(RequestError, match="outside"):
        eng.add_request([-1], greedy(4))
    assert eng.abort(eng.add_request(torch.tensor(ok), greedy(1)))  # an integer tensor's items are ids too
    out = eng.generate([ok], greedy(4))[0]
    assert out.finished and len(out.token_ids) == 4


# ---- finishing ------------------------------------------------------------------------------------


def test_max_tokens_gives_length(engines) -> None:
    eng = engines.get("build")
    prompt = prompt_ids("build", eng.tokenizer, 1, 64)[0]
    for n in (1, 5):
        out = eng.generate([prompt], greedy(n))[0]
        assert out.finished and out.finish_reason == "length" and len(out.token_ids) == n


def test_stop_string_and_stop_token(engines) -> None:
    eng = engines.get("build")
    prompt = prompt_ids("build", eng.tokenizer, 1, 64, skip=1)[0]
    full = eng.generate([prompt], greedy())[0]
    assert full.finish_reason == "length"
    # a stop string: some visible text from the middle of the continuation
    pieces = [(i, eng.tokenizer.decode([t]).strip()) for i, t in enumerate(full.token_ids)]
    i, stop = next((i, s) for i, s in pieces[8:] if len(s) >= 2)
    cut = full.text.index(stop)
    out = eng.generate([prompt], greedy(stop=[stop]))[0]
    assert out.finished and out.finish_reason == "stop"
    assert out.text == full.text[:cut] and stop not in out.text
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) <= i + 1
    # a stop token id: finishes at its first occurrence
    t = full.token_ids[6]
    first = full.token_ids.index(t)
    out = eng.generate([prompt], greedy(stop_token_ids=[t]))[0]
    assert out.finished and out.finish_reason == "stop"
    assert out.token_ids in (full.token_ids[:first], full.token_ids[:first + 1])
    assert out.text == eng.tokenizer.decode(full.token_ids[:first])


def test_eos_stops(engines) -> None:
    eng = engines.get("build")
    tok = eng.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the gnulib module `getrusage`?"}],
                                   tokenize=False, add_generation_prompt=True)
    out = eng.generate([text], SamplingParams(max_tokens=64))[0]
    assert out.finished and out.finish_reason == "stop", (out.finish_reason, out.text)
    assert "<|im_end|>" not in out.text and out.text.strip()
    assert out.token_ids[-1] == tok.eos_token_id and tok.eos_token_id not in out.token_ids[:-1]
    # ignore_eos runs on past it
    on = eng.generate([text], SamplingParams(max_tokens=len(out.token_ids) + 4, ignore_eos=True))[0]
    assert on.finish_reason == "length" and on.token_ids[:len(out.token_ids)] == out.token_ids


# ---- sampling and streaming ---------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible(engines) -> None:
    one = engines.get("build", fresh=True)
    two = engines.get("build", fresh=True)
    prompts = prompt_ids("build", one.tokenizer, 4, 64)

    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=16, temperature=0.8, top_k=50, top_p=0.9, seed=seed, ignore_eos=True)

    a = [o.token_ids for o in one.generate(prompts, params(123))]
    b = [o.token_ids for o in two.generate(prompts, params(123))]
    c = [o.token_ids for o in two.generate(prompts, params(456))]
    assert a == b
    assert any(x != y for x, y in zip(a, c))
    assert a != [o.token_ids for o in one.generate(prompts, greedy(16))]  # it really sampled


@pytest.mark.parametrize("domain", MODELS)
def test_stream_matches_generate(domain: str, engines) -> None:
    eng = engines.get(domain)
    prompt = prompt_ids(domain, eng.tokenizer, 1, 64, skip=3)[0]
    params = greedy(20)

    async def collect() -> list[RequestOutput]:
        return [o async for o in eng.stream(prompt, params)]

    snaps = asyncio.run(collect())
    lengths = [len(s.token_ids) for s in snaps]
    assert lengths == sorted(lengths) and lengths[-1] == 20 and len(snaps) >= 2
    for s, t in zip(snaps, snaps[1:]):
        assert t.token_ids[:len(s.token_ids)] == s.token_ids
    assert all(not s.finished for s in snaps[:-1]) and snaps[-1].finished and snaps[-1].finish_reason == "length"
    ref = eng.generate([prompt], params)[0]
    assert snaps[-1].token_ids == ref.token_ids and snaps[-1].text == ref.text


# ---- static buffers, batch-size buckets -----------------------------------------------------------------


@pytest.mark.parametrize("domain", MODELS)
def test_bucket_padding_changes_nothing(domain: str, engines) -> None:
    """Decode and verify batches padded to batch-size buckets (padding rows in the scratch KV block and
    SSM slot) give the same tokens as unpadded ones, speculation off and on, and keep every invariant."""
    from policies.policy import SpeculationPolicy
    from specialists.runner import bucket_size

    assert [bucket_size(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    outs = {}
    for pad in (False, True):
        for mode in ("off", "on"):
            eng = engines.get(domain, fresh=True, pad_batches=pad, draft_min_confidence=0.0,
                              policy=SpeculationPolicy(mode=mode, num_speculative_tokens=3))
            prompts = [p[-n:] for p, n in zip(prompt_ids(domain, eng.tokenizer, 5, 64, skip=2), (64, 30, 47, 12, 58))]
            outs[pad, mode] = [o.token_ids for o in eng.generate(prompts, greedy(20))]
            assert (eng.runner.padded_steps > 0) == pad  # 5 rows -> bucket 8 on every decode / verify step
            if eng.ssm is not None:  # the scratch slot is never written by padding rows' commits
                assert eng.ssm.scratch_slot not in eng.ssm._owned
    for key, got in outs.items():
        assert got == outs[False, "off"], f"{key}: differs from the unpadded, non-speculative run"


def test_time_gate_falls_back_where_speculation_cannot_pay(engines) -> None:
    """auto.min_speedup on a real engine: an unreachable target (9x) ends in fallback for being slow,
    after a baseline measurement; a modest one (0.2x) keeps speculating. Outputs stay exact either way."""
    from policies.policy import AutoGating, SpeculationPolicy

    outs = {}
    for target in (9.0, 0.2):
        policy = SpeculationPolicy(mode="auto", num_speculative_tokens=3,
                                   auto=AutoGating(window=12, cooldown_s=0.02, min_acceptance=0.0, min_speedup=target))
        eng = engines.get("build", fresh=True, policy=policy, draft_min_confidence=0.0)
        prompt = prompt_ids("build", eng.tokenizer, 1, 64, skip=1)
        reasons, figures = [], []
        rid = eng.add_request(prompt[0], greedy(96))
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs[target] = o.token_ids
            reasons.append(eng.gate.snapshot()["reason"])
            figures.append(eng.gate.speedup(1))
        assert "baseline" in reasons, reasons
        assert ("slow" in reasons) == (target > 1), reasons  # 9x never happens; 0.2x always does
        if target < 1:
            # back on after the baseline, and it stays on (but for its refreshes: gate.REFRESH_FIRST)
            assert "probe" in reasons[reasons.index("baseline"):] and reasons[-1] in ("probe", "baseline"), reasons
        # the gate measured both sides (a run may end just after a refresh dropped the plain figure for a
        # fresh one, "baseline" above: then speedup() is None at the end; ~1 run in 10 on a 2-core CPU)
        assert any(f is not None for f in figures), reasons
        del rid
    plain = engines.get("build", policy=SpeculationPolicy(mode="off")).generate([prompt[0]], greedy(96))[0].token_ids
    assert outs[9.0] == outs[0.2] == plain
