"""The engine's paged drafter: drafts equal the dense reference chain (mtp.draft_greedy) on a shipped
specialist, a draft vocabulary restricts what is proposed, a confidence floor stops chains early,
and `specialists.train draft-vocab` writes the most frequent tokens first."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from policies.policy import SpeculationPolicy
from specialists.engine import Engine
from specialists.models.batch import ForwardBatch
from specialists.models.mtp import draft_greedy
from specialists.sampling import SamplingParams
from specialists.train.draftvocab import MTP_VOCAB, write_draft_vocab
from state.kv_cache import KVCache

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "deploy" / "models" / "build"


def _engine(**kw) -> Engine:
    return Engine.from_pretrained(MODEL, policy=SpeculationPolicy(mode="on", num_speculative_tokens=3), max_num_seqs=1, **kw)


def _prompt(engine: Engine) -> list[int]:
    row = json.loads((ROOT / "bench" / "data" / "build" / "prompts.jsonl").read_text().splitlines()[0])
    return engine.tokenizer(row["prompt"], add_special_tokens=False)["input_ids"][-100:]


def _capture(engine: Engine, prompt: list[int], max_tokens: int = 30) -> list[tuple[list[int], list[int], int]]:
    """(committed ids, drafts, drafts to verify) of every drafting step."""
    seen = []
    orig = engine.speculator._draft

    def spy(seqs, kmax):
        drafts, counts = orig(seqs, kmax)
        seen.append((list(seqs[0].all_ids), drafts[0].tolist(), counts[0]))
        return drafts, counts

    engine.speculator._draft = spy
    propose = engine.speculator.propose

    def spy_static(plan):  # a static batch (one sequence here): the drafts it verifies, from the step's
        proposal = propose(plan)  # own chain or drafted ahead
        if plan.static is not None and proposal.drafts is not None:
            seen.append((list(plan.rows[0].seq.all_ids), proposal.drafts[0].tolist(), proposal.drafts.shape[1]))
        return proposal

    engine.speculator.propose = spy_static
    engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return seen


@pytest.mark.parametrize("static", [False, True, "fused"])
def test_paged_drafts_equal_the_dense_reference(static) -> None:
    """The eager chain (exact context width), the static one (a CUDA graph's: the context padded to
    a width bucket and masked on the device) and the fused static one (Triton kernels, chained
    entries in the pool; here through Triton's interpreter) propose what the dense reference proposes;
    the static ones also when drafted ahead of the step, right after the previous verify."""
    fused = static == "fused"
    if fused:
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the fused kernels on CPU tensors need TRITON_INTERPRET=1 (set by tests/conftest.py)")
    engine = _engine(draft_vocab_size=0, draft_min_confidence=0.0, pad_batches=bool(static),
                     static_batches=bool(static), fused_drafter=fused)
    assert (engine.drafter.fused is not None) == fused
    seen = _capture(engine, _prompt(engine))
    assert (engine.runner.static_steps > 0) == bool(static)
    assert (engine.speculator.ahead_used > 0) == bool(static)  # static steps: most drafts were drafted ahead
    m, drafter = engine.model, engine.drafter.drafter
    checked = 0
    for ids, drafts, _ in seen:
        if len(drafts) < 3:
            continue  # the last steps draft fewer (max_tokens)
        kv = KVCache(m.kv_cache_config(64, 16, False))
        kv.add_sequence(0, ids[:-1])
        kv.reserve(0, len(ids) - 1)
        hidden = m.forward(ForwardBatch.from_kv(kv, [(0, ids[:-1], True)]), kv, None)
        ref = draft_greedy(drafter, hidden, torch.tensor(ids), m.embed, m.lm_head, 3).tolist()
        assert drafts == ref, (len(ids), drafts, ref)
        checked += 1
    assert checked >= 5


def test_draft_vocabulary_restricts_the_drafts() -> None:
    engine = _engine(draft_vocab_size=64, draft_min_confidence=0.0)
    allowed = set(load_file(str(MODEL / MTP_VOCAB))["token_ids"][:64].tolist())
    seen = _capture(engine, _prompt(engine))
    assert seen and all(t in allowed for _, drafts, _ in seen for t in drafts)


def test_confidence_floor_stops_chains() -> None:
    never = _capture(_engine(draft_min_confidence=0.0), _prompt(_engine()))
    assert all(n == len(d) for _, d, n in never)
    engine = _engine(draft_min_confidence=0.999)  # almost nothing is that sure: most chains stop at once
    seen = _capture(engine, _prompt(engine))
    assert any(n < len(d) for _, d, n in seen)
    assert engine.totals.drafted < sum(len(d) for _, d, _ in seen)


def test_draft_vocab_file_is_most_frequent_first(tmp_path: Path) -> None:
    counts = np.array([5, 0, 9, 1, 7], dtype=np.int64)
    info = write_draft_vocab(counts, 3, tmp_path)
    assert load_file(str(tmp_path / MTP_VOCAB))["token_ids"].tolist() == [2, 4, 0]
    assert info == {"size": 3, "coverage": round(21 / 22, 4)}
