"""Static batches (specialists/runner.py): the fixed-shape decode / verify steps that run as CUDA
graphs on a GPU. On the CPU (CI) the same static forward runs eagerly (static_batches=True); with
CANTATA_TEST_DEVICE=cuda these tests run the captured graphs.

Checked against the eager engine on the same weights: greedy tokens identical, plain and speculative,
alone and 3 concurrent (padded to a bucket of 4), for a Llama and a Mamba2 hybrid specialist; the KV
and SSM invariants hold after every step (the engine asserts them); sampled speculation is seeded
and repeatable; on CUDA the graphs are captured once per shape and replayed after.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from policies.policy import SpeculationPolicy
from specialists.engine import Engine
from specialists.options import OptionsError
from specialists.runner import MIN_CONTEXT_WIDTH, context_width
from specialists.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DEV = os.environ.get("CANTATA_TEST_DEVICE", "cpu")
CUDA = DEV.startswith("cuda")


def _engine(domain: str, static: bool, mode: str = "on", k: int = 3, seqs: int = 4, **options) -> Engine:
    flags = {"cuda_graphs": static} if CUDA else {"static_batches": static, "pad_batches": static}
    return Engine.from_pretrained(ROOT / "deploy" / "models" / domain, device=DEV, dtype=torch.float32, max_num_seqs=seqs,
                                  num_blocks=256, policy=SpeculationPolicy(mode=mode, num_speculative_tokens=k), **flags, **options)


def _prompts(engine: Engine, domain: str, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in (ROOT / "bench" / "data" / domain / "prompts.jsonl").read_text().splitlines()]
    out = [engine.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"][-90:] for r in rows[:n]]
    return [p for p in out if len(p) >= 8]


def _run(engine: Engine, prompts: list[list[int]], batch: int, new: int = 24) -> list[list[int]]:
    out = []
    for i in range(0, len(prompts), batch):
        out += [o.token_ids for o in engine.generate(prompts[i:i + batch], SamplingParams(max_tokens=new, ignore_eos=True))]
    assert not engine.has_unfinished()
    engine.kv.check_invariants()
    return out


def test_context_width_buckets() -> None:
    assert context_width(1, 4096) == MIN_CONTEXT_WIDTH
    assert context_width(MIN_CONTEXT_WIDTH, 4096) == MIN_CONTEXT_WIDTH
    assert context_width(MIN_CONTEXT_WIDTH + 1, 4096) == 2 * MIN_CONTEXT_WIDTH
    assert context_width(3000, 2080) == 2080  # capped at the tables' full width


@pytest.mark.parametrize("domain", ["shell", "cpp"])  # Llama; Mamba2 hybrid
@pytest.mark.parametrize("batch", [1, 3])
def test_static_steps_equal_eager_steps(domain: str, batch: int) -> None:
    outs = {}
    for static in (False, True):
        for mode in ("off", "on"):
            eng = _engine(domain, static, mode)
            prompts = _prompts(eng, domain, 6)
            outs[static, mode] = _run(eng, prompts, batch)
            steps = eng.runner.static_steps
            assert (steps > 0) == static, steps
            if static:
                # every decode / verify step of a batch of one shape is static (prefills are not)
                assert steps >= eng.steps - len(prompts) - 1, (steps, eng.steps)
                if CUDA:
                    g = eng.runner.graphs
                    assert 0 < g.captures <= 2 * len(g) and g.replays >= steps, (g.captures, len(g), g.replays)
                    if mode == "on":
                        assert eng.drafter.graphs.captures > 0
            if mode == "on":
                assert eng.totals.as_dict()["drafted"] > 0
    ref = outs[False, "off"]
    for key, got in outs.items():
        assert got == ref, key  # exact: speculation, static batches (graphs) and both


def test_a_hybrids_static_steps_share_one_staged_buffer_per_role() -> None:
    """Every static step of a hybrid writes its Mamba states into views of one buffer per role
    (specialists/staged_states.py), not into per-shape outputs: after the warm-up's captures and
    batches of 1 and 3 (buckets 1 and 4) at K=3, then plain, the buffers hold the largest step's
    tokens, max_num_seqs' bucket x (K+1) for decodes and verifies and x decode_steps for each copy of
    the multi-step decode (CUDA: two copies, decoding ahead); every graph's staged outputs view them."""
    eng = _engine("cpp", True, "on", k=3, seqs=4)
    eng.capture_graphs()  # as a served engine's warm-up does (none on a CPU)
    prompts = _prompts(eng, "cpp", 4)
    _run(eng, prompts[:1], 1)
    _run(eng, prompts, 3)
    eng.set_policy(SpeculationPolicy(mode="off"))  # plain steps: multi-step decodes on CUDA, decoded ahead
    _run(eng, prompts, 3)
    runner = eng.runner
    per_token = eng.ssm.conv[0].nbytes + eng.ssm.ssm[0].nbytes  # one row's states of every Mamba layer
    multi = runner._copies * runner.decode_steps if runner.decode_steps > 1 else 0
    assert runner.staged.nbytes == 4 * (4 + multi) * per_token, (runner.staged.nbytes, per_token)
    bases = {b.ssm.untyped_storage().data_ptr() for b in runner.staged._buffers.values()}
    outputs = [e.outputs for e in runner.graphs._graphs.values()]
    staged = [o.staged if hasattr(o, "staged") else o[2] for o in outputs]
    assert len(staged) == len(runner.graphs) and (len(staged) > 0) == CUDA
    assert all(s.ssm.untyped_storage().data_ptr() in bases for s in staged)


def test_a_hybrids_staged_state_budget_shrinks_k_and_decode_steps_not_the_tokens() -> None:
    """staged_state_mib bounds what one static step stages (specialists/staged_states.py): with room for
    8 tokens of the toy's states, batch 1 verifies K=3 (up to 7) and decodes 4 tokens a step, bucket 4
    verifies 1 draft and decodes 2 a step (8 tokens each); the greedy tokens, speculative and plain
    (multi-step, decoded ahead), equal the eager engine's, and no role's buffer holds more than 8 tokens."""
    ref = _engine("cpp", False, "off")
    prompts = _prompts(ref, "cpp", 4)
    want = _run(ref, prompts[:1], 1) + _run(ref, prompts, 3)
    per_token = ref.ssm.conv[0].nbytes + ref.ssm.ssm[0].nbytes
    eng = _engine("cpp", True, "on", k=3, seqs=4, decode_steps=4, decode_ahead=True, staged_state_mib=8.5 * per_token / 2**20)
    eng.capture_graphs()
    runner = eng.runner
    assert runner.staged.max_tokens == 8
    assert [runner.max_drafts(b) for b in (1, 2, 3)] == [7, 3, 1] and [runner.multi_steps(b) for b in (1, 2, 3)] == [4, 4, 2]
    assert _run(eng, prompts[:1], 1) + _run(eng, prompts, 3) == want  # speculative
    assert eng.totals.as_dict()["drafted"] > 0
    eng.set_policy(SpeculationPolicy(mode="off"))
    assert _run(eng, prompts[:1], 1) + _run(eng, prompts, 3) == want  # plain: multi-step decodes
    assert eng.speculator.decoding.stats()["used"] > 0
    assert 0 < max(b.ssm.shape[0] for b in runner.staged._buffers.values()) <= 8
    with pytest.raises(OptionsError, match="staged_state_mib"):
        _engine("cpp", True, staged_state_mib=0)


def test_warm_up_reserves_each_staged_role_at_its_largest_step() -> None:
    """Runner.reserve_staged (what a GPU warm-up calls before its captures) sizes each role's buffer
    for the largest step of the shapes it will capture, so that no buffer grows afterwards: a graph
    captured over a buffer that was later replaced would keep the old one alive. Here K=3 over buckets
    1..4 (decodes and verifies: 4 x 4 tokens) and two copies of a 4-step decode (4 x 4 each); steps of
    batches 1 and 3, speculative and plain, then write into those same buffers."""
    eng = _engine("cpp", True, "on", k=3, seqs=4, decode_steps=4, decode_ahead=True)
    runner = eng.runner
    runner.reserve_staged(runner.graph_shapes(4), 3)
    bufs = {role: (b.ssm.data_ptr(), b.ssm.shape[0]) for role, b in runner.staged._buffers.items()}
    assert bufs and {role: n for role, (_, n) in bufs.items()} == {"step": 16, ("multi", 0): 16, ("multi", 1): 16}
    prompts = _prompts(eng, "cpp", 4)
    _run(eng, prompts[:1], 1)
    _run(eng, prompts, 3)
    eng.set_policy(SpeculationPolicy(mode="off"))
    _run(eng, prompts, 3)
    assert eng.speculator.decoding.stats()["used"] > 0 and eng.totals.as_dict()["drafted"] > 0
    assert {role: (b.ssm.data_ptr(), b.ssm.shape[0]) for role, b in runner.staged._buffers.items()} == bufs


@pytest.mark.parametrize("domain", ["shell", "cpp"])  # Llama; Mamba2 hybrid
def test_drafting_ahead_proposes_the_chains_drafts(domain: str) -> None:
    """The chain drafted on the device right after a greedy verify (spec/speculator.py) proposes exactly
    what the step's own chain would: the same tokens, drafts and accepted counts with it and without.
    It is used when every run was committed whole and the same sequences decode next; a stop token
    cutting a run and a request finishing make the next step draft its own chain (missed)."""
    seen = []
    ref = _engine(domain, True, "off")
    prompts = _prompts(ref, domain, 4)
    stop = _run(ref, prompts[1:2], 1, 28)[0][12]  # a token prompt 1 meets mid-way
    params = [SamplingParams(max_tokens=24 + 4 * i, ignore_eos=True, stop_token_ids=[stop] if i == 1 else [])
              for i in range(len(prompts))]
    for ahead in (False, True):
        eng = _engine(domain, True)
        eng.speculator.ahead = ahead
        outs = [o.token_ids for o in eng.generate(prompts[:1], params[:1]) + eng.generate(prompts, params)]
        stats = eng.totals.as_dict()
        seen.append((outs, stats["drafted"], stats["accepted"]))
        spec = eng.speculator
        if ahead:
            assert spec.ahead_used > 0 and spec.ahead_missed > 0, (spec.ahead_used, spec.ahead_missed)
        else:
            assert spec.ahead_used == spec.ahead_missed == 0
        eng.kv.check_invariants()
    assert seen[0] == seen[1]
    assert len(seen[1][0][2]) < 24 + 4, "the stop token never cut a run"  # prompt 1 of the batch


@pytest.mark.parametrize("domain", ["build", "python"])
def test_static_sampled_speculation_is_seeded(domain: str) -> None:
    """Rejection sampling through static batches: the same seeds give the same tokens; the accepted
    counts come back through the step's one copy (stats add up)."""
    runs = []
    for _ in range(2):
        eng = _engine(domain, True)
        eng.set_policy(eng.gate.policy.model_copy(update={"acceptance": "rejection"}))
        prompts = _prompts(eng, domain, 3)
        params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=11 + i, ignore_eos=True)
                  for i in range(len(prompts))]
        outs = eng.generate(prompts, params)
        assert eng.runner.static_steps > 0
        stats = eng.totals.as_dict()
        assert stats["drafted"] > 0 and 0 <= stats["accepted"] <= stats["drafted"]
        runs.append([o.token_ids for o in outs])
        assert all(len(t) == 20 for t in runs[-1])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("M,G", [(1, 2), (4, 2), (5, 1)])
def test_grouped_attention_matches_sdpa(M: int, G: int) -> None:
    """The static batches' (and the CUDA chain's) attention: two batched products over grouped heads,
    against SDPA with enable_gqa, under a causal mask given as an additive bias."""
    from specialists.ops.attention import grouped_attention

    torch.manual_seed(M * 10 + G)
    B, hkv, d, N = 3, 2, 16, 37
    q, k, v = torch.randn(B, M, hkv * G, d), torch.randn(B, N, hkv, d), torch.randn(B, N, hkv, d)
    pos = torch.tensor([N - M, 20, 9])[:, None] + torch.arange(M)  # [B, M] the queries' positions
    mask = torch.arange(N)[None, None, :] <= pos[..., None]  # [B, M, N]
    bias = torch.zeros(B, M, N).masked_fill(~mask, float("-inf"))
    got = grouped_attention(q, k, v, bias, d ** -0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None], enable_gqa=G > 1).transpose(1, 2)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_a_step_verifies_at_most_what_keeps_its_products_exact() -> None:
    """Runner.max_drafts caps K per batch bucket so that a static step stays within the rows whose
    products are row-invariant (on CUDA in half precision 64; here lowered to 16 to drive the cap on
    any device): batch 4 verifies at most 3 drafts, batch 2 the policy's 5, batch 8 none; the output
    equals plain decoding."""
    eng = _engine("shell", True, "on", k=5, seqs=8)
    eng.runner.exact_rows = 16
    assert [eng.runner.max_drafts(b) for b in (1, 2, 3, 4, 8)] == [15, 7, 3, 3, 1]
    plain = _engine("shell", True, "off", seqs=8)
    prompts = _prompts(eng, "shell", 8)
    rows, static_step = [], eng.runner._static_step  # every static step's rows, padding included
    eng.runner._static_step = lambda batch, *a, **k: (rows.append(batch.num_tokens), static_step(batch, *a, **k))[1]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for batch, most in ((2, 5), (4, 3), (8, 1)):
        outs = eng.generate(prompts[:batch], params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts[:batch], params)]
        assert most in {k for o in outs for k in o.stats.ks}, batch  # the capped K ran (a batch's tail may run more)
    assert rows and max(rows) <= 16, max(rows)
    eng.kv.check_invariants()
