"""The drafter's lazy catch-up (spec/catchup.py): plain steps that skip the drafter's rebuild (the
auto gate's fallback, a policy switched off) leave its entries owed, and the next step that rebuilds
writes them first. Checked on the shell specialist (CPU, eager): after an off stretch in the middle
of a request the drafter's cache holds, at every committed position, the entries an engine that
never stopped speculating has; without the catch-up it does not (the test can fail); the owed
entries are capped, forgotten with their sequence, and speculative output still equals plain."""

from __future__ import annotations

from pathlib import Path

import torch

from policies.policy import SpeculationPolicy
from spec import catchup
from specialists.engine import Engine
from specialists.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "find all files larger than 10 megabytes in the current directory and print their sizes"


def _engine(mode: str = "on") -> Engine:
    return Engine.from_pretrained(ROOT / "deploy" / "models" / "shell", max_num_seqs=2, num_blocks=64,
                                  policy=SpeculationPolicy(mode=mode, num_speculative_tokens=3))


def _drive(eng: Engine, off_steps: range, total: int) -> tuple[str, list[int]]:
    """One greedy request, `total` steps, speculation off during off_steps; -> (request id, tokens)."""
    on = eng.gate.policy
    rid = eng.add_request(eng.tokenizer(PROMPT, add_special_tokens=False)["input_ids"],
                          SamplingParams(max_tokens=200, ignore_eos=True))
    out = []
    for i in range(total):
        eng.set_policy(on.model_copy(update={"mode": "off"}) if i in off_steps else on)
        for o in eng.step():
            out = list(o.token_ids)
    return rid, out


def _entries(eng: Engine, rid: str, n: int) -> torch.Tensor:
    """The drafter's keys at the request's first n positions."""
    seq = eng._seqs[rid]
    table = eng.kv.block_table(seq.seq_id)
    bs = eng.kv.block_size
    slots = [table[p // bs] * bs + p % bs for p in range(n)]
    k = eng.drafter.k.view(-1, *eng.drafter.k.shape[2:])
    return k[torch.tensor(slots)]


def _compare(off_steps: range, total: int) -> tuple[bool, int]:
    ref, eng = _engine(), _engine()
    rid_ref, toks_ref = _drive(ref, range(0), total)
    rid, toks = _drive(eng, off_steps, total)
    n = min(len(toks), len(toks_ref)) - 4  # committed positions both engines have rebuilt by now
    prompt = len(eng._seqs[rid].prompt_ids)
    return torch.equal(_entries(eng, rid, prompt + n), _entries(ref, rid_ref, prompt + n)), n


def test_resume_writes_the_owed_entries() -> None:
    same, n = _compare(range(3, 12), 18)  # 9 plain steps in the middle, then speculation again
    assert n > 20 and same


def test_without_the_catch_up_the_entries_are_stale(monkeypatch) -> None:
    monkeypatch.setattr(catchup.CatchUp, "run", lambda self, runner, drafter, seq_ids, computed: 0)
    same, _ = _compare(range(3, 12), 18)
    assert not same


def test_owed_entries_are_capped_and_forgotten(monkeypatch) -> None:
    monkeypatch.setattr(catchup, "CAP", 5)
    eng = _engine()
    rid, _ = _drive(eng, range(2, 40), 20)  # off from step 2 on: 18 plain steps owed, capped
    sid = eng._seqs[rid].seq_id
    owed = eng.speculator.owed(sid)
    assert 5 <= owed < 5 + 2
    eng.abort(rid)
    assert eng.speculator.owed(sid) == 0


def test_speculation_with_catch_up_equals_plain() -> None:
    plain = _engine("off")
    _, want = _drive(plain, range(0), 40)
    _, got = _drive(_engine(), range(5, 25), 40)
    n = min(len(want), len(got))
    assert n >= 39 and got[:n] == want[:n]


def _drive_fallback(eng: Engine, fallback_steps: int, total: int) -> tuple[str, list[int]]:
    """One greedy request whose first `fallback_steps` steps (its prefill included) run under the
    gate's fallback: plain steps that skip the rebuild while speculation is expected back."""
    decide = eng.gate.decide
    eng.gate.decide = lambda batch, guided=False: "fallback" if eng.steps < fallback_steps else decide(batch, guided)
    return _drive(eng, range(0), total)


def test_a_prompt_prefilled_in_fallback_is_caught_up_on_resume() -> None:
    """A request that arrives while the gate measures or holds plain decoding owes its prompt's
    entries too: once the gate resumes, the drafter's cache equals an always-speculating engine's at
    every committed position (prompt included), so its drafts read no stale entries."""
    ref, eng = _engine(), _engine()
    rid_ref, toks_ref = _drive(ref, range(0), 18)
    rid, toks = _drive_fallback(eng, 9, 18)
    n = min(len(toks), len(toks_ref)) - 4
    prompt = len(eng._seqs[rid].prompt_ids)
    assert n > 10 and torch.equal(_entries(eng, rid, prompt + n), _entries(ref, rid_ref, prompt + n))


def test_a_policy_off_from_the_start_owes_nothing() -> None:
    """Speculation off (not a fallback) from a request's first step: nothing is kept for it, so
    plain decoding pays no catch-up bookkeeping; a fallback from the first step keeps its tokens."""
    off, fallback = _engine("off"), _engine()
    rid_off, _ = _drive(off, range(0), 6)
    rid_fb, _ = _drive_fallback(fallback, 100, 6)
    assert off.speculator.owed(off._seqs[rid_off].seq_id) == 0
    owed = fallback.speculator.owed(fallback._seqs[rid_fb].seq_id)
    assert owed == len(fallback._seqs[rid_fb].prompt_ids) + 5  # the prompt, then 5 decodes


class _Seq:
    def __init__(self, seq_id: int, num_tokens: int) -> None:
        self.seq_id, self.num_tokens = seq_id, num_tokens


def test_the_log_walks_each_sequence_back_to_its_recompute() -> None:
    """The log's walk (spec/catchup.py): two sequences owe interleaved decode steps; one is preempted
    and prefilled again from position 0 (a recompute), and its owed tokens then start there, not
    in the steps logged before; the other owes every step since it had entries."""
    from spec.step import Row

    cu, d = catchup.CatchUp(), 4
    pos = {1: 10, 2: 20}  # committed lengths
    hid = lambda n, v: torch.full((n, d), float(v))  # noqa: E731 - each step's hidden states tell it apart
    for step in range(3):  # both decode (they have entries)
        rows = [Row(_Seq(1, pos[1] + 1), False, [0], 0, 0), Row(_Seq(2, pos[2] + 1), False, [0], 0, 1)]
        cu.stash(rows, {1, 2}, True, hid(2, step), torch.tensor([[7], [8]]), lambda: None, pos.get)
        pos[1] += 1
        pos[2] += 1
    pos[1] = 0  # 1 preempted: its KV freed, then prefilled again (6 tokens), with 2 decoding beside it
    rows = [Row(_Seq(1, 6), True, [5] * 6, 0, 0), Row(_Seq(2, pos[2] + 1), False, [0], 0, 6)]
    cu.stash(rows, {1, 2}, True, hid(7, 9), torch.tensor([[3], [4]]), lambda: torch.arange(7), pos.get)
    pos[1], pos[2] = 6, pos[2] + 1
    assert cu.owed(1, pos.get) == 6 and cu.owed(2, pos.get) == 4

    class Drafter:
        def rebuild(self, batch, hidden, toks):  # noqa: ANN001, ANN202
            self.got = (batch, hidden[:, 0].tolist(), toks.tolist())

    class Runner:
        def history_batch(self, spans):  # noqa: ANN001, ANN202
            return spans

    dr = Drafter()
    assert cu.run(Runner(), dr, [1, 2], pos.get) == 10
    spans, hidden, toks = dr.got
    assert spans == [(1, 0, 6), (2, 20, 4)]
    assert hidden == [9.0] * 6 + [0.0, 1.0, 2.0, 9.0]  # 1: the recompute only; 2: its three steps, then its row of the last
    assert toks == [0, 1, 2, 3, 4, 5] + [8, 8, 8, 6]
    assert not cu.owes and cu.owed(1, pos.get) == 0
