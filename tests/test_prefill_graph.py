"""specialists/prefill_graph.py: a fresh prompt's prefill padded to a length of PREFILL_LENGTHS (a CUDA
graph per length on a GPU; on the CPU the same padded forward runs eagerly). Checked against eager
prefills on the same weights: the first token's logits and the greedy tokens after, the KV the prompt
wrote, plain and speculative; steps that are no fresh prefill (a prefix hit, prompts past the cap)
stay eager. Hybrids: tests/test_hybrid_prefix_cache.py. With CANTATA_TEST_DEVICE=cuda the graphs run
(bf16 too)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from policies.policy import SpeculationPolicy
from specialists.engine import Engine
from specialists.options import EngineOptions, OptionsError
from specialists.prefill_graph import prefill_length
from specialists.runner import BatchRow
from specialists.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DEV = os.environ.get("CANTATA_TEST_DEVICE", "cpu")
CUDA = DEV.startswith("cuda")


def _engine(domain: str, tokens: int, mode: str = "off", dtype: torch.dtype = torch.float32, **kw) -> Engine:
    return Engine.from_pretrained(ROOT / "deploy" / "models" / domain, device=DEV, dtype=dtype, max_num_seqs=4,
                                  num_blocks=256, prefill_graph_tokens=tokens,
                                  policy=SpeculationPolicy(mode=mode, num_speculative_tokens=3), **kw)


def _prompts(n: int, lengths: tuple[int, ...] = (5, 40, 127, 128, 129, 300)) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(10, 2000, (n,), generator=g).tolist() for n in lengths]


def test_prefill_lengths() -> None:
    assert [prefill_length(n, 2048) for n in (1, 128, 129, 2048)] == [128, 128, 256, 2048]
    assert prefill_length(2049, 2048) is None and prefill_length(300, 256) is None  # past the cap: eager
    assert EngineOptions().resolve().prefill_graph_tokens == 0  # the CPU's default: every prefill eager
    with pytest.raises(OptionsError, match="prefill_graph_tokens"):
        EngineOptions(prefill_graph_tokens=-1).resolve()


def _prefill(engine: Engine, prompts: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The runner's step for fresh prompts -> per prompt (its last logits row, hidden states, the K of
    every layer it wrote)."""
    kv, rows = engine.kv, []
    for i, prompt in enumerate(prompts):
        assert kv.add_sequence(900 + i, prompt) == 0
        kv.reserve(900 + i, len(prompt))
        rows.append(BatchRow(900 + i, prompt, True, -1))
    res = engine.runner.run(rows)
    out, t = [], 0
    for i, prompt in enumerate(prompts):
        slots = torch.tensor(kv.slot_mapping(900 + i, 0, len(prompt)))
        k = kv.k.view(kv.k.shape[0], -1, *kv.k.shape[3:])[:, slots].float().cpu()
        out.append((res.logits[i].cpu(), res.hidden[t:t + len(prompt)].float().cpu(), k))
        t += len(prompt)
        kv.free(900 + i)
    assert res.hidden.shape[0] == t and res.logits.shape[0] == len(prompts)
    return out


def test_a_padded_prefill_computes_the_eager_prefills_logits_and_kv() -> None:
    """Prompts of 5-600 tokens through the runner, one per step, and three and two in one step (rows
    padded to one length, buckets of 4 and 2 rows): the last logits row, every real token's hidden state and the K the
    prompt wrote equal the eager prefill's to fp32 noise (the padding tokens after each prompt change
    none of them; their K/V went to the scratch block); past the cap the step is eager."""
    padded, eager = _engine("shell", 512), _engine("shell", 0)
    steps = [[p] for p in _prompts(1, (5, 40, 127, 128, 129, 600))] + [_prompts(2, (5, 100, 61)), _prompts(3, (128, 17))]
    for prompts in steps:
        for a, b in zip(_prefill(padded, prompts), _prefill(eager, prompts)):
            for x, y in zip(a, b):
                assert x.shape == y.shape and torch.allclose(x, y, atol=1e-4, rtol=1e-4), (len(prompts), (x - y).abs().max())
    assert padded.stats["padded_prefills"] == 7 and eager.stats["padded_prefills"] == 0  # 600 > 512: eager


@pytest.mark.parametrize("mode", ["off", "on"])
def test_greedy_tokens_after_a_padded_prefill_equal_the_eager_engines(mode: str) -> None:
    """Plain and speculative decoding after padded prefills: the eager engine's greedy tokens; the
    invariants hold after every step."""
    padded, eager = _engine("shell", 256, mode), _engine("shell", 0, mode)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for prompt in _prompts(4, (7, 60, 200)):
        assert padded.generate([prompt], params)[0].token_ids == eager.generate([prompt], params)[0].token_ids
    assert padded.stats["padded_prefills"] == 3
    padded.kv.check_invariants()


@pytest.mark.parametrize("domain", ["shell", "cpp"])  # attention-only, hybrid
def test_warming_the_row_tiles_leaves_every_state_as_it_was(domain: str) -> None:
    """The warm-up's eager forwards of 32 and 64 padding tokens (Triton's row tiles on a GPU) write only
    the scratch block and slot: a request decoding around them keeps the tokens of an engine without them."""
    prompt = _prompts(9, (50,))[0]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    warmed = _engine(domain, 512)
    rid = warmed.add_request(prompt, params)
    outs = warmed.step() + warmed.step()
    assert warmed.runner.prefills.warm_rows() == 2
    while warmed.has_unfinished():
        outs += warmed.step()
    warmed.kv.check_invariants()
    done = [o.token_ids for o in outs if o.request_id == rid and o.finished]
    assert done == [_engine(domain, 0).generate([prompt], params)[0].token_ids]


def test_which_steps_prefill_padded() -> None:
    """Padded: a fresh prompt, two short fresh prompts in one step (rows of 128), a prompt alone after a
    prefix hit (a graph per length and context width), a hybrid's fresh prompt; prompts that one graph
    cannot take together (2 x 512 > 512 tokens) are admitted a step apart, and after decodes waited a
    step the next one is theirs alone (no eager mixed step). Eager: a prompt past the cap, a hit whose context and
    padded length pass the widest context (the model's 2,048 positions here)."""
    prompts = _prompts(2, (40, 70))
    llama = _engine("shell", 512)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = llama.generate([prompts[0] * 2], params)[0].token_ids
    assert llama.stats["padded_prefills"] == 1
    assert llama.generate([prompts[0] * 2], params)[0].token_ids == first  # a prefix hit: padded after its context
    assert llama.stats["padded_prefills"] == 2 and llama.stats["padded_hit_prefills"] == 1 and llama.stats["prefix_hit_tokens"] == 64
    llama.generate([p[::-1] for p in prompts], params)  # one step of two fresh prompts: rows of 128 (cap 512)
    assert llama.stats["padded_prefills"] == 3
    steps = llama.steps
    x, y, z = _prompts(7, (160, 280, 50))  # nothing cached: 160 + 280 tokens, then a hit of 80, then 50
    together = [x, y, prompts[0] * 2 + [5], z]
    eager = _engine("shell", 0)
    assert [o.token_ids for o in llama.generate(together, params)] == [o.token_ids for o in eager.generate(together, params)]
    # 160 alone (280 more would pass the cap), then 280 alone (the decodes wait), the decodes alone, then
    # the hit and 50 as one graph (the decodes wait again)
    assert llama.stats["padded_prefills"] == 6 and llama.stats["padded_hit_prefills"] == 2
    assert llama.stats["prefix_hit_tokens"] == 64 + 80
    long = _prompts(3, (1700,))[0]
    llama.generate([long], SamplingParams(max_tokens=1))  # eager: past the cap
    llama.generate([long[:1600] + prompts[1] * 4], params)  # 1,600 cached + 280 new padded to 512 > 2,048
    assert llama.stats["padded_prefills"] == 6 and llama.stats["prefix_hit_tokens"] >= 144 + 1600 and llama.steps > steps
    hybrid, eager = _engine("cpp", 512), _engine("cpp", 0)  # a hybrid's fresh prompt: padded too
    assert hybrid.generate([prompts[1]], params)[0].token_ids == eager.generate([prompts[1]], params)[0].token_ids
    assert hybrid.stats["padded_prefills"] == 1


def _hit_prefill(engine: Engine, cached: list[int], new: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The runner's step for `new` after `cached` (put in the KV cache by an eager step first) -> (its
    last logits row, hidden states, the K of every layer it wrote)."""
    kv, ssm = engine.kv, engine.ssm
    slot = ssm.allocate() if ssm is not None else -1  # a hybrid: its state after `cached` stays in the slot
    assert kv.add_sequence(950, cached + new) == 0
    kv.reserve(950, len(cached))
    engine.runner.run([BatchRow(950, cached, True, slot)], static=False)
    kv.commit(950, cached, len(cached))
    kv.reserve(950, len(new))
    res = engine.runner.run([BatchRow(950, new, True, slot)])
    slots = torch.tensor(kv.slot_mapping(950, len(cached), len(new)))
    k = kv.k.view(kv.k.shape[0], -1, *kv.k.shape[3:])[:, slots].float().cpu()
    kv.free(950)
    if ssm is not None:
        state = ssm.ssm[slot].clone()
        assert torch.isfinite(state).all()
        ssm.free(slot)
        k = torch.cat([k.flatten(), state.flatten().cpu()])  # compared with the K
    return res.logits[0].cpu(), res.hidden.float().cpu(), k


def test_a_padded_prefill_after_a_prefix_hit_computes_the_eager_ones() -> None:
    """New tokens after 16-1,000 cached ones, padded to 128-512 and attending over contexts gathered at
    widths 256-2,048: the last logits row, every new token's hidden state and the K it wrote equal the
    eager step's to fp32 noise; 1,700 cached + 300 new (padded: 2,212 past the 2,080 positions): eager."""
    padded, eager = _engine("shell", 512), _engine("shell", 0)
    cases = [(16, 5), (100, 40), (127, 129), (250, 6), (1000, 300), (1700, 300)]
    for i, (c, q) in enumerate(cases):
        cached, new = _prompts(100 + i, (c, q))
        for x, y in zip(_hit_prefill(padded, cached, new), _hit_prefill(eager, cached, new)):
            assert x.shape == y.shape and torch.allclose(x, y, atol=1e-4, rtol=1e-4), (c, q, (x - y).abs().max())
    assert padded.stats["padded_hit_prefills"] == 5 and eager.stats["padded_prefills"] == 0


@pytest.mark.parametrize("domain", ["shell", "cpp"])  # attention-only, hybrid
@pytest.mark.parametrize("mode", ["off", "on"])
def test_prompts_after_prefix_hits_prefill_together_padded(mode: str, domain: str) -> None:
    """Three prompts sharing a cached head and a fresh one, submitted together: one padded step of four
    rows (the hits' contexts gathered at one width, the hybrid's rows from their restored snapshots, the
    fresh row from a zero state), with the greedy tokens of an engine without the prefix cache or padding."""
    head, fresh = _prompts(5, (100, 40))
    together = [head + t for t in _prompts(6, (3, 30, 70))] + [fresh]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    padded = _engine(domain, 512, mode)
    padded.generate([head + [7]], params)
    before = dict(padded.stats)
    outs = [o.token_ids for o in padded.generate(together, params)]
    assert outs == [o.token_ids for o in _engine(domain, 0, mode, enable_prefix_cache=False).generate(together, params)]
    grew = {k: padded.stats[k] - before[k] for k in ("padded_prefills", "padded_hit_prefills", "prefix_hit_tokens")}
    assert grew == {"padded_prefills": 1, "padded_hit_prefills": 1, "prefix_hit_tokens": 3 * 96}, grew
    padded.kv.check_invariants()
    if domain == "cpp":
        assert padded.stats["ssm_snapshots_restored"] == 3
        padded.snapshots.check_invariants()
    later = together[2] + _prompts(8, (20,))[0]  # hits the blocks (and the hybrid's snapshots) the 4-row step stored
    hits = padded.stats["prefix_hit_tokens"]
    assert padded.generate([later], params)[0].token_ids == _engine(domain, 0, mode, enable_prefix_cache=False).generate([later], params)[0].token_ids
    assert padded.stats["prefix_hit_tokens"] - hits == 160  # 170 prompt tokens: 10 full blocks


@pytest.mark.skipif(not CUDA, reason="flash attention's variable-length form: CANTATA_TEST_DEVICE=cuda")
@pytest.mark.parametrize("domain", ["shell", "cpp"])  # attention-only, hybrid
def test_a_hit_prefill_in_half_precision_takes_flash_attention(monkeypatch: pytest.MonkeyPatch, domain: str) -> None:
    """bf16 on a GPU: a prompt's tokens after a prefix hit attend through flash attention's variable-length
    form in the prefill graph (lengths on the device); the first token's logits and every new token's
    hidden state match the eager step's (the memory-efficient kernel over the gathered context) to bf16
    rounding, the greedy first token is the same, and the hybrid's slot holds finite states close to the
    eager step's (the padding's rows come out zero, not uninitialized, before its Mamba layers)."""
    from specialists.ops import attention

    calls = []
    after_hit = attention._after_hit
    monkeypatch.setattr(attention, "_after_hit", lambda q, *a: calls.append(q.shape[0]) or after_hit(q, *a))
    padded, eager = _engine(domain, 512, dtype=torch.bfloat16), _engine(domain, 0, dtype=torch.bfloat16)
    for i, (c, q) in enumerate([(96, 40), (256, 6), (992, 300)]):  # the cpp hybrid's hits end on its 16-token grid
        cached, new = _prompts(200 + i, (c, q))
        calls.clear()
        (la, ha, ka), (lb, hb, kb) = _hit_prefill(padded, cached, new), _hit_prefill(eager, cached, new)
        assert calls and set(calls) == {128 if q <= 128 else 512}, calls  # every attention layer, the padded rows
        assert la.argmax() == lb.argmax() and torch.nn.functional.cosine_similarity(ha, hb, dim=-1).min() > 0.99
        assert torch.nn.functional.cosine_similarity(ka.flatten(), kb.flatten(), dim=0) > 0.99  # the K written (and the hybrid's state)


@pytest.mark.skipif(not CUDA, reason="flash attention's variable-length form: CANTATA_TEST_DEVICE=cuda")
@pytest.mark.parametrize("domain", ["shell", "cpp"])  # attention-only, hybrid
def test_several_hit_prefills_in_half_precision_take_flash_attention(monkeypatch: pytest.MonkeyPatch, domain: str) -> None:
    """bf16 on a GPU: three prompts after prefix hits of different lengths and a fresh one, in one padded
    step of four rows of 128 through flash attention's variable-length form (each row's keys used on the
    device); their first tokens are those of an engine without the prefix cache or padding."""
    from specialists.ops import attention

    calls = []
    after_hit = attention._after_hit
    monkeypatch.setattr(attention, "_after_hit", lambda q, *a: calls.append(q.shape[0]) or after_hit(q, *a))
    heads = _prompts(210, (96, 112, 256))
    fresh = _prompts(211, (50,))[0]
    together = [h + t for h, t in zip(heads, _prompts(212, (20, 60, 5)))] + [fresh]
    one = SamplingParams(max_tokens=1)
    padded = _engine(domain, 512, dtype=torch.bfloat16)
    padded.generate([h + [3] for h in heads], one)
    calls.clear()
    outs = [o.token_ids for o in padded.generate(together, one)]
    assert calls and set(calls) == {4 * 128}, calls
    assert padded.stats["prefix_hit_tokens"] == 96 + 112 + 256
    eager = _engine(domain, 0, dtype=torch.bfloat16, enable_prefix_cache=False)
    assert outs == [o.token_ids for o in eager.generate(together, one)]


@pytest.mark.skipif(not CUDA, reason="CUDA graphs: CANTATA_TEST_DEVICE=cuda")
@pytest.mark.parametrize("domain", ["shell", "cpp"])  # attention-only, hybrid
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_graphs_are_captured_once_per_length_and_replayed(dtype: torch.dtype, domain: str) -> None:
    """On a GPU: the warm-up captures every shape up to the cap (one prompt of each length, several
    rows of the shorter ones; fresh, and after prefix hits at each context width); prompts alone and two together replay them (no new capture); speculative
    output equals plain output (another engine: no prefix hits), both prefilled through the graphs, and
    in fp32 equals the eager engine's."""
    padded = _engine(domain, 512, "on", dtype)
    graphs = padded.runner.graphs
    prefills = lambda: [key for key in graphs.keys() if key[0] == "prefill"]  # noqa: E731
    shapes = [(1, 128), (1, 256), (1, 512), (2, 128), (2, 256), (4, 128)]  # max_num_seqs 4, cap 512 tokens
    widths = [256, 512, 1024, 2048, 2080]  # context widths up to the block tables' 2,080 positions
    hits = [(b, n, w) for b, n in shapes for w in widths if w >= 2 * n]  # prompts after prefix hits
    assert padded.runner.capture_prefills() == 32 and prefills() == [("prefill", *s) for s in shapes + hits]
    assert padded.runner.capture_prefills() == 0  # captured once
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = _prompts(3, (5, 127, 200, 511))
    together = [p[::-1] for p in prompts[:2]]  # rows (2, 128)

    def run(engine: Engine) -> list[list[int]]:
        return [engine.generate([p], params)[0].token_ids for p in prompts] + [o.token_ids for o in engine.generate(together, params)]

    spec = run(padded)
    assert len(prefills()) == 32 and padded.stats["padded_prefills"] == 5  # replayed: no capture in a request
    plain = _engine(domain, 512, "off", dtype)
    assert run(plain) == spec and plain.stats["padded_prefills"] == 5
    if dtype == torch.float32:
        assert run(_engine(domain, 0, "off", dtype)) == spec
    padded.kv.check_invariants()


@pytest.mark.skipif(not CUDA, reason="CUDA graphs: CANTATA_TEST_DEVICE=cuda")
@pytest.mark.parametrize("domain", ["shell", "cpp"])  # attention-only, hybrid
@pytest.mark.parametrize("mode", ["off", "on"])
def test_prefix_hits_prefill_through_graphs_too(mode: str, domain: str) -> None:
    """On a GPU, fp32: a fresh prompt prefilled by a graph (the cpp hybrid: leaving snapshots on its
    grid); prompts sharing its head hit its blocks and prefill the rest through the graphs after a hit
    (the hybrid's from the restored state), with the tokens of an engine without the prefix cache or
    padding."""
    head = _prompts(5, (100,))[0]
    prompts = [head + t for t in _prompts(6, (3, 30, 70))]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    padded = _engine(domain, 512, mode)
    outs = [padded.generate([p], params)[0].token_ids for p in prompts]
    stats = padded.stats
    assert stats["padded_prefills"] == 3 and stats["padded_hit_prefills"] == 2 and stats["prefix_hit_tokens"] == 2 * 96, stats
    eager = _engine(domain, 0, mode, enable_prefix_cache=False)
    assert outs == [eager.generate([p], params)[0].token_ids for p in prompts]
    if domain == "cpp":
        assert stats["ssm_snapshots_restored"] == 2
        padded.snapshots.check_invariants()
