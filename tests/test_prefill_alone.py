"""Prompts arriving among running decodes when prefill graphs are on (specialists/scheduler.py,
prefill_alone): prompts and decodes never share a step. A step of prompts (one graph, or a prompt past
the cap, eagerly) runs while the decodes wait, and the step after it is the decodes' alone, so they never
wait two steps in a row; speculating, their next chains start from the drafter's outputs kept from
before; greedy tokens equal the eager engine's. With CANTATA_TEST_DEVICE=cuda the graphs run."""

from __future__ import annotations

import pytest
import torch

from policies.policy import SpeculationPolicy
from specialists.engine import Engine
from specialists.sampling import SamplingParams
from tests.test_prefill_graph import CUDA, _engine, _prompts


def test_running_decodes_never_wait_two_steps_in_a_row() -> None:
    """Three fresh 200-token prompts arrive among a running decode (cap 256: one a graph): each prefills
    alone (the decode waits) and the decode runs alone the step after, never waiting two steps in a row;
    greedy tokens equal the eager engine's."""
    a, *late = _prompts(8, (30, 200, 200, 200))
    padded, eager = _engine("shell", 256), _engine("shell", 0)
    (toks, rows), (ref, _) = _staggered(padded, [a], late), _staggered(eager, [a], late)
    assert toks == ref and rows == 1 and padded.stats["padded_prefills"] == 4  # a, then each of the three
    rid = padded.add_request(a[::-1], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        padded.step()
    for p in late:
        padded.add_request(p[::-1], SamplingParams(max_tokens=4, ignore_eos=True))
    progressed = [any(o.request_id == rid for o in padded.step()) for _ in range(8)]  # on a GPU a step decoded
    assert progressed.count(False) == 3 and padded.stats["padded_prefills"] == 8  # ahead may come first; each
    assert all(progressed[i] or progressed[i + 1] for i in range(7))  # prompt alone, then the decode alone


def test_a_prompt_past_the_cap_prefills_alone_too() -> None:
    """A prompt past the graphs' cap (300 tokens, cap 256) arriving among running decodes prefills eagerly
    in a step of its own (in half precision an eager mixed step's products change bits with its row
    count), then the decodes run alone; greedy tokens equal the eager engine's, and a prompt longer than
    max_num_batched_tokens minus the running decodes is still admitted while they run."""
    a, b = _prompts(9, (30, 40))
    late = _prompts(10, (300,))
    padded, eager = _engine("shell", 256), _engine("shell", 0)
    (toks, rows), (ref, ref_rows) = _staggered(padded, [a, b], late), _staggered(eager, [a, b], late)
    assert toks == ref and (rows, ref_rows) == (1, 3) and padded.stats["padded_prefills"] == 1  # a and b: one graph
    padded.scheduler.max_num_batched_tokens = 301  # the prompt fits the budget alone, not beside 2 decodes
    (toks, rows) = _staggered(padded, [p[::-1] for p in (a, b)], [late[0][::-1]])
    assert rows == 1 and len(toks) == 3


def _staggered(engine: Engine, prompts: list[list[int]], late: list[list[int]],
               during: str | None = None) -> tuple[list[list[int]], int]:
    """prompts start together; after 3 steps the `late` ones arrive together (the steps until they are
    prefilled under policy mode `during`, the engine's own mode after) -> (every request's tokens, the
    number of rows of the step that prefilled them: on a GPU a step decoded ahead may come first)."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    done: dict[str, list[int]] = {}

    def step() -> list:
        outs = engine.step()
        done.update((o.request_id, o.token_ids) for o in outs if o.finished)
        return outs

    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(3):
        step()
    new = [engine.add_request(p, params) for p in late]
    mode = engine.gate.policy.mode
    if during is not None:
        engine.set_policy(SpeculationPolicy(mode=during, num_speculative_tokens=3))
    outs = step()
    while not any(o.request_id in new for o in outs):
        outs = step()
    engine.set_policy(SpeculationPolicy(mode=mode, num_speculative_tokens=3))
    while engine.has_unfinished():
        step()
    ids += new
    arrival_rows = len(outs)
    engine.kv.check_invariants()
    return [done[i] for i in ids], arrival_rows


@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_fresh_prompt_arriving_among_decodes_prefills_alone(mode: str) -> None:
    """A lone fresh prompt that arrives while others decode prefills in a step of its own (a graph on a
    GPU, where the mixed step would run eagerly); the decodes wait that one step (speculating: their
    next chains start from the drafter's outputs kept from before it); so do one after a prefix hit and
    two fresh ones arriving together (one graph of two rows). A speculating engine whose arrival step does not speculate (a
    switch) drafts again after it. Greedy tokens equal the eager engine's."""
    a, b, c, d = _prompts(5, (30, 50, 40, 90))
    padded, eager = _engine("shell", 256, mode), _engine("shell", 0, mode)
    (toks, rows), (ref, ref_rows) = _staggered(padded, [a, b], [c]), _staggered(eager, [a, b], [c])
    assert toks == ref and (rows, ref_rows) == (1, 3)
    if mode == "on":  # the arrival step plain (no rebuild): alone; the decodes speculate again after a plain step
        drafted = padded.totals.as_dict()["drafted"]
        fresh = [p[::-1] for p in (a, b, c)]  # no prefix hits of the run before
        (toks, rows), (ref, _) = (_staggered(e, fresh[:2], fresh[2:], "off") for e in (padded, eager))
        assert toks == ref and rows == 1 and padded.totals.as_dict()["drafted"] > drafted
    late = [[t + 3 for t in b], [t + 3 for t in c]]  # not seen before (b, c reversed ran above in mode on: hits)
    (toks, rows), (ref, _) = _staggered(padded, [a], late), _staggered(eager, [a], late)
    assert toks == ref and rows == 2  # two arrivals: one prefill graph of two rows (the decodes wait)
    for e in (padded, eager):  # d's blocks cached (and, speculating, marked as holding the drafter's entries)
        e.generate([d], SamplingParams(max_tokens=4, ignore_eos=True))
    if mode == "on":  # the waiting sequences' chain starts survive the arrival's step bit for bit
        spec, params = padded.speculator, SamplingParams(max_tokens=40, ignore_eos=True)
        ids = [padded.add_request(p, params) for p in ([t + 2 for t in a], [t + 2 for t in b])]
        for _ in range(3):
            padded.step()
        padded.add_request([t + 2 for t in c], params)
        for ahead in range(2):  # on a GPU a verify launched ahead before the arrival comes first (the decodes)
            before = {sid: spec._draft_out[i].clone() for sid, i in spec._draft_index.items()}
            if len(padded.step()) == 1:
                break
        assert (ahead == 0 or CUDA) and set(before) <= set(spec._draft_index)
        assert all(torch.equal(spec._draft_out[spec._draft_index[sid]], row) for sid, row in before.items())
        for rid in ids:
            padded.abort(rid)
        while padded.has_unfinished():
            padded.step()
    hits = padded.stats["prefix_hit_tokens"]
    other = [t + 1 for t in a]  # a prompt not seen before
    toks, rows = _staggered(padded, [other], [d[:80] + [7]])  # a prefix hit of d's 5 blocks: alone too
    assert padded.stats["prefix_hit_tokens"] == hits + 80 and rows == 1 and padded.stats["padded_hit_prefills"] >= 1
    assert toks == _staggered(eager, [other], [d[:80] + [7]])[0]
