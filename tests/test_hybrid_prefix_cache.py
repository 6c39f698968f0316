"""The prefix cache on a hybrid (issue 20 A): a tiny random Bamba (bench/shapes.py "tiny-bamba": Mamba,
attention, Mamba; SSD chunks of 32 tokens, KV blocks of 16) with a random MTP drafter, fp32 on CPU.

Checked: greedy tokens with the prefix cache on equal those with it off, with and without speculation
(an oracle drafter, so that verifies cross block boundaries with some drafts kept and some rejected),
alone and 8 concurrent, prompts sharing and not sharing prefixes; every snapshot in the pool is the
state after exactly its entry's prefix (never a draft position's) and a hit leaves the slot where a
fresh prefill would, to 1e-6; a hit whose KV has no snapshot falls back to the longest prefix that has
one; small KV and snapshot pools (preemption, eviction) lose nothing; skipping the restore is caught.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from bench.shapes import build_checkpoint
from policies.policy import SpeculationPolicy
from specialists.engine import Engine
from specialists.models.batch import ForwardBatch
from specialists.ops.mamba2 import Mamba2Params, mamba2_prefill, mamba2_prefill_at
from specialists.sampling import SamplingParams
from state.kv_cache import KVCache
from state.prefix_cache import ROOT_ENTRY
from state.ssm_cache import SSMCache

TOL = 1e-6
NEW = 24
BS = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # weights of std 0.1: greedy continuations that depend on the state (std 0.02 repeats one token)
    return build_checkpoint("tiny-bamba", tmp_path_factory.mktemp("tiny-bamba"), torch.float32, "cpu", drafter_k=3,
                            overrides={"initializer_range": 0.1})


def _engine(ckpt: Path, spec: bool = False, prefix: bool = True, **kw) -> Engine:
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("num_blocks", 256)
    policy = SpeculationPolicy(mode="on" if spec else "off", num_speculative_tokens=3)
    return Engine.from_pretrained(ckpt, policy=policy, enable_prefix_cache=prefix, block_size=BS, **kw)


def _prompts(seed: int = 0) -> list[list[int]]:
    """8 sharing a 40-token "system prompt" (two full blocks and a partial one), 2 of them sharing 70
    tokens, 8 sharing nothing; lengths across SSD chunk and block boundaries."""
    rng = random.Random(seed)
    rand = lambda n: [rng.randrange(5, 4000) for _ in range(n)]  # noqa: E731
    system = rand(40)
    shared = [system + rand(rng.randrange(3, 60)) for _ in range(6)]
    longer = system + rand(30)
    shared += [longer + rand(9), longer + rand(21)]
    alone = [rand(rng.randrange(10, 90)) for _ in range(8)]
    return [p for pair in zip(shared, alone) for p in pair]  # interleaved: batches mix both kinds


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> list[list[int]]:
    """Greedy tokens of every prompt with the prefix cache off and no speculation."""
    return [o.token_ids for o in _engine(ckpt, prefix=False).generate(_prompts(), _params())]


class _Oracle:
    """Drafts the reference continuation with 0..k leading correct tokens, then wrong ones."""

    def __init__(self, engine: Engine, refs: dict[str, list[int]], seed: int) -> None:
        self.engine, self.refs, self.rng = engine, refs, random.Random(seed)
        self.kept: list[int] = []
        spec = engine.speculator
        spec._draft = self  # eager chains; static batches (CANTATA_STATIC_BATCHES=1) below, padding rows last
        spec._draft_static = lambda plan: torch.cat([
            self([r.seq for r in plan.rows], plan.k)[0], torch.zeros(plan.static.rows - len(plan.rows), plan.k, dtype=torch.int64)])

    def __call__(self, seqs, kmax: int):
        rows = []
        for seq in seqs:
            ref, pos = self.refs[seq.request_id], len(seq.output_ids)
            good = self.rng.choice([0, kmax, self.rng.randint(0, kmax)])
            self.kept.append(good)
            truth = [ref[pos + j] if pos + j < len(ref) else 0 for j in range(kmax)]
            rows.append([t if j < good else (t + 1 + self.rng.randrange(4000)) % 4096 for j, t in enumerate(truth)])
        return torch.tensor(rows, dtype=torch.int64), [kmax] * len(rows)


def _run(engine: Engine, prompts: list[list[int]], refs: list[list[int]] | None, seed: int = 0) -> list[list[int]]:
    """Greedy tokens; with refs, drafts come from the oracle. Checks the caches after every step."""
    rids = [engine.add_request(p, _params()) for p in prompts]
    if refs is not None:
        _Oracle(engine, dict(zip(rids, refs)), seed)
    final: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o.token_ids
        engine.kv.check_invariants()
        if engine.snapshots is not None:
            engine.snapshots.check_invariants()
    return [final[r] for r in rids]


def _fresh_state(engine: Engine, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """conv [L, ...] and SSM [L, ...] state of every Mamba layer after one fresh prefill of `tokens`."""
    model = engine.model
    kv = KVCache(model.kv_cache_config(-(-len(tokens) // BS) + 1, BS, False))
    ssm = SSMCache(model.ssm_cache_config(1))
    slot = ssm.allocate()
    kv.add_sequence(0, tokens)
    kv.reserve(0, len(tokens))
    model.forward(ForwardBatch.from_kv(kv, [(0, tokens, True)], [slot]), kv, ssm)
    return ssm.conv[slot].clone(), ssm.ssm[slot].clone()


def _entry_tokens(engine: Engine) -> dict[int, list[int]]:
    """Every prefix-cache entry id -> the tokens of the whole prefix it stands for (entries whose
    parent was evicted, which no lookup reaches any more, are left out)."""
    entries = {e.entry_id: e for e in engine.kv.prefix.entries()}
    out: dict[int, list[int]] = {}
    for eid in entries:
        toks, e = [], entries[eid]
        while e is not None:
            toks[:0] = e.token_ids
            if e.parent_entry_id == ROOT_ENTRY:
                out[eid] = toks
            e = entries.get(e.parent_entry_id)
    return out


def _assert_snapshots_are_their_prefixes(engine: Engine) -> int:
    tokens = _entry_tokens(engine)
    snaps = engine.snapshots
    checked = 0
    for eid, idx in snaps._index.items():
        if eid not in tokens:
            continue
        checked += 1
        conv, ssm = _fresh_state(engine, tokens[eid])
        torch.testing.assert_close(snaps.conv[idx], conv, atol=TOL, rtol=TOL)
        torch.testing.assert_close(snaps.ssm[idx], ssm, atol=TOL, rtol=TOL)
    return checked


# ---- the op ----------------------------------------------------------------------------------------


@torch.no_grad()
def test_prefill_at_gives_the_states_of_prefix_prefills(ckpt: Path) -> None:
    engine = _engine(ckpt)
    p: Mamba2Params = next(layer.mamba for layer in engine.model.layers if layer.mamba is not None)
    torch.manual_seed(1)
    u, conv0, ssm0 = torch.randn(100, 64), torch.randn(p.conv_dim, 3), torch.randn(p.num_heads, p.head_dim, p.d_state)
    at = [1, 16, 32, 33, 64, 99, 100]  # inside, at and past SSD chunk ends (32); segments of 1 to 35 tokens
    y, conv, ssm, conv_at, ssm_at = mamba2_prefill_at(p, u, conv0, ssm0, at)
    y_ref, conv_ref, ssm_ref = mamba2_prefill(p, u, conv0, ssm0)
    assert torch.equal(y, y_ref) and torch.equal(conv, conv_ref) and torch.equal(ssm, ssm_ref)
    for i, n in enumerate(at):
        _, c, s = mamba2_prefill(p, u[:n], conv0, ssm0)
        torch.testing.assert_close(conv_at[i], c, atol=TOL, rtol=TOL)
        torch.testing.assert_close(ssm_at[i], s, atol=TOL, rtol=TOL)
    with pytest.raises(ValueError):
        mamba2_prefill_at(p, u, conv0, ssm0, [16, 8])


# ---- the engine ------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_num_seqs", [1, 8], ids=["alone", "concurrent8"])
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_prefix_cache_on_equals_off(ckpt: Path, reference: list[list[int]], spec: bool, max_num_seqs: int) -> None:
    engine = _engine(ckpt, spec=spec, max_num_seqs=max_num_seqs)
    assert engine.kv.cfg.enable_prefix_cache and engine.snapshots is not None  # on by default for hybrids
    prompts = _prompts()
    for rnd in range(2):  # the second round hits the first round's blocks too
        assert _run(engine, prompts, reference if spec else None, seed=rnd) == reference, f"round {rnd}"
    stats = engine.stats
    assert stats["prefix_hit_tokens"] >= 8 * 32 and stats["ssm_snapshots_restored"] > 0, stats
    if spec:
        assert engine.totals.accepted > 0 and engine.totals.accepted < engine.totals.drafted  # kept and rejected
    assert _assert_snapshots_are_their_prefixes(engine) > 0
    assert engine.kv.num_free_blocks() == engine.kv.pool.num_blocks


@pytest.mark.parametrize("padded", [0, 512], ids=["eager", "padded"])
def test_state_after_a_hit_equals_a_fresh_prefill(ckpt: Path, padded: int) -> None:
    """After a hit, the slot holds a fresh prefill's state, the rest prefilled eagerly or padded (a
    prefill graph's path after a prefix hit: its state from the restored snapshot)."""
    engine = _engine(ckpt, spec=True, prefill_graph_tokens=padded)
    first, second = _prompts()[0], _prompts()[2]  # share the 40-token system prompt: a 32-token hit
    engine.generate([first], _params())
    restored = engine.snapshots.restored
    rid = engine.add_request(second, _params())
    engine.step()  # admission (hit + restore) and the prefill of the rest
    assert engine.snapshots.restored == restored + 1 and engine.stats["prefix_hit_tokens"] == 32
    assert engine.stats["padded_hit_prefills"] == (1 if padded else 0)
    seq = engine._seqs[rid]
    conv, ssm = _fresh_state(engine, second)
    torch.testing.assert_close(engine.ssm.conv[seq.ssm_slot], conv, atol=TOL, rtol=TOL)
    torch.testing.assert_close(engine.ssm.ssm[seq.ssm_slot], ssm, atol=TOL, rtol=TOL)
    while engine.has_unfinished():
        engine.step()


def test_hit_without_state_falls_back_to_the_longest_prefix_with_both(ckpt: Path, reference) -> None:
    """A pool of 2 snapshots: after a 70-token prompt only the states at 48 and 64 are kept. A prompt
    sharing 56 tokens hits 48 (3 blocks, with state); then one sharing 40 has KV for 32 tokens but no
    state at 16 or 32, so it hits nothing and prefills from scratch, with the same tokens."""
    engine = _engine(ckpt, ssm_snapshots=2, max_num_seqs=1)
    plain = _engine(ckpt, prefix=False, max_num_seqs=1)
    rng = random.Random(5)
    a = [rng.randrange(5, 4000) for _ in range(70)]
    c = a[:56] + [rng.randrange(5, 4000) for _ in range(20)]
    b = a[:40] + [rng.randrange(5, 4000) for _ in range(20)]
    engine.generate([a], SamplingParams(max_tokens=1))
    assert engine.stats["ssm_snapshots"] == 2 and engine.stats["ssm_snapshots_evicted"] == 2
    outs = []
    for prompt, hit, unusable in ((c, 48, 0), (b, 0, 32)):
        before = dict(engine.stats)
        outs.append(engine.generate([prompt], _params())[0].token_ids)
        assert engine.stats["prefix_hit_tokens"] - before["prefix_hit_tokens"] == hit
        assert engine.stats["prefix_hit_tokens_without_state"] - before["prefix_hit_tokens_without_state"] == unusable
    assert outs == [o.token_ids for o in plain.generate([c, b], _params())]
    engine.snapshots.check_invariants()


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_small_pools_lose_nothing(ckpt: Path, spec: bool) -> None:
    """12 KV blocks for 8 concurrent requests (preemption by recompute, cached blocks evicted) and 3
    snapshots (evicted by LRU, and with their blocks): the same tokens, nothing leaked."""
    engine = _engine(ckpt, spec=spec, num_blocks=12, ssm_snapshots=3)
    prompts = [p[:60] for p in _prompts()]
    want = [o.token_ids for o in _engine(ckpt, prefix=False).generate(prompts, _params())]
    assert _run(engine, prompts, want if spec else None) == want
    stats = engine.stats
    assert stats["preemptions"] > 0 and stats["ssm_snapshots_evicted"] > 0, stats
    assert engine.snapshots.dropped > 0  # snapshots that left with their evicted blocks
    _assert_snapshots_are_their_prefixes(engine)
    assert engine.kv.num_free_blocks() == engine.kv.pool.num_blocks and engine.ssm.num_free() == 8


def test_a_hit_without_the_restore_is_caught(ckpt: Path, reference: list[list[int]]) -> None:
    """The check above can fail: KV hits with the Mamba state left at zero change the tokens."""
    engine = _engine(ckpt)
    engine.snapshots.restore = lambda *a: None
    prompts = _prompts()
    outs = [engine.generate([p], _params())[0].token_ids for p in prompts]
    assert engine.stats["prefix_hit_tokens"] > 0
    assert outs != reference


def test_zero_snapshots_turns_the_hybrid_prefix_cache_off(ckpt: Path) -> None:
    engine = _engine(ckpt, ssm_snapshots=0)
    assert engine.snapshots is None and not engine.kv.cfg.enable_prefix_cache
    engine.generate(_prompts()[:4], _params())
    assert engine.stats["prefix_hit_tokens"] == 0


def test_bench_prefix_ttft_counts_hits_and_keeps_tokens(ckpt: Path) -> None:
    """bench.decode --prefix-ttft's figures on prompts sharing a 40-token head: the first request hits
    nothing, the later ones the head's two full blocks, with the same tokens as without the cache."""
    from bench import prefix_ttft

    prompts = _prompts()[0:12:2]  # the ones sharing the head
    res = prefix_ttft.measure(lambda cache: _engine(ckpt, spec=True, prefix=cache, max_num_seqs=1), prompts, 8, rounds=1)
    assert res["prefix_hit_tokens_first"] == 0 and res["prefix_hit_tokens_later"] >= 32
    assert res["identical_prefix_cache"] == 1.0
    assert res["ttft_first_ms"] > 0 and res["ttft_later_ms"] > 0 and res["ttft_later_speedup"] > 0


# ---- the snapshot grid and padded prefills (a CUDA graph's on a GPU; eager here) -----------------------


def test_the_default_grid_keeps_snapshots_per_token_bounded() -> None:
    """Every block for the toys' small states, every 256 tokens for bamba-1b's 24.3 MiB; asked strides
    must be multiples of the block size."""
    from specialists.options import EngineOptions, OptionsError
    from state.ssm_cache import SSMCacheConfig
    from state.ssm_snapshots import default_stride, pool_shape, snapshot_bytes

    bamba_1b = SSMCacheConfig(8, 12, 4096 + 256, 4, 64, 64, 128, conv_dtype=torch.bfloat16)
    toy = SSMCacheConfig(8, 3, 640, 4, 8, 64, 64)
    assert snapshot_bytes(bamba_1b) > 24 << 20 and default_stride(bamba_1b, 16) == 256 and default_stride(toy, 16) == 16
    assert pool_shape(bamba_1b, 4096, 16, None, None) == (10, 256) and pool_shape(toy, 100, 16, None, 32) == (50, 32)
    with pytest.raises(OptionsError, match="ssm_snapshot_stride"):
        EngineOptions(ssm_snapshot_stride=24).resolve()


@torch.no_grad()
def test_a_padded_prefill_gives_each_prompts_states_and_grid(ckpt: Path) -> None:
    """Rows of 5, 33 and 64 tokens padded to 64: each row's outputs, final states and the states every 16
    tokens equal the eager prefill's of the prompt alone (the padding's dt is 0)."""
    from specialists.ops.mamba2_padded import mamba2_prefill_padded

    engine = _engine(ckpt)
    p: Mamba2Params = next(layer.mamba for layer in engine.model.layers if layer.mamba is not None)
    torch.manual_seed(2)
    lens = [5, 33, 64]
    u = torch.randn(3, 64, 64)
    y, conv, ssm, conv_at, ssm_at = mamba2_prefill_padded(p, u, torch.tensor(lens), 16)
    assert conv_at.shape[:2] == ssm_at.shape[:2] == (3, 3)  # counts 16, 32, 48
    for b, T in enumerate(lens):
        y_ref, conv_ref, ssm_ref = mamba2_prefill(p, u[b, :T])
        torch.testing.assert_close(y.view(3, 64, -1)[b, :T], y_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv[b], conv_ref, atol=TOL, rtol=TOL)
        torch.testing.assert_close(ssm[b], ssm_ref, atol=TOL, rtol=TOL)
        for i, n in enumerate(n for n in (16, 32, 48) if n < T):
            _, c, s = mamba2_prefill(p, u[b, :n])
            torch.testing.assert_close(conv_at[b, i], c, atol=TOL, rtol=TOL)
            torch.testing.assert_close(ssm_at[b, i], s, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_padded_prefills_with_the_prefix_cache_equal_eager_ones(ckpt: Path, reference: list[list[int]], spec: bool) -> None:
    """Fresh prompts prefilled padded (rows of 128 and 256 tokens, one and several a step), then prompts
    that hit their snapshots (eager over the rest): the reference's greedy tokens; every snapshot is its
    prefix's state; the hits restored states that padded prefills made."""
    engine = _engine(ckpt, spec=spec, prefill_graph_tokens=512)
    prompts = _prompts()
    for rnd, concurrent in enumerate((False, True)):
        outs = _run(engine, prompts, reference if spec else None, seed=rnd) if concurrent else \
            [_run(engine, [p], [r] if spec else None, seed=rnd)[0] for p, r in zip(prompts, reference)]
        assert outs == reference, f"round {rnd}"
    stats = engine.stats
    assert stats["padded_prefills"] >= 8 and stats["ssm_snapshots_restored"] > 0 and stats["prefix_hit_tokens"] >= 8 * 32, stats
    assert stats["padded_hit_prefills"] > 0  # alone in their step after a hit: padded from the restored state
    assert _assert_snapshots_are_their_prefixes(engine) > 0


def test_a_coarser_grid_hits_only_on_it(ckpt: Path, reference: list[list[int]]) -> None:
    """Snapshots every 32 tokens: hits end on the grid (the 40-token head hits 32, the 70-token one 64),
    with the same tokens."""
    engine = _engine(ckpt, ssm_snapshot_stride=32, max_num_seqs=1)
    prompts = _prompts()
    assert [engine.generate([p], _params())[0].token_ids for p in prompts] == reference
    stats = engine.stats
    assert stats["ssm_snapshot_stride"] == 32 and stats["prefix_hit_tokens"] > 0 and stats["prefix_hit_tokens"] % 32 == 0
    before, head = dict(stats), prompts[0][:50] + [7] * 20  # a 48-token KV hit, whose state is at 32
    engine.generate([head], _params())
    assert engine.stats["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 32
    assert engine.stats["prefix_hit_tokens_without_state"] - before["prefix_hit_tokens_without_state"] == 16
    assert _assert_snapshots_are_their_prefixes(engine) > 0
    tokens = _entry_tokens(engine)
    assert all(len(tokens[e]) % 32 == 0 for e in engine.snapshots._index if e in tokens)
