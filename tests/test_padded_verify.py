"""A row without drafts of its own among speculating rows (inside a tool call, near a limit) verifies
the step's K drafts without keeping any (scheduler.plan_drafts: pad_k; spec/speculator.py: plan.limits),
so the step stays one static shape (a CUDA graph on a GPU) instead of an eager mixed step. On the CPU
the static steps run eagerly (static_batches=True: the same shapes and bookkeeping).

Against the engine with speculation off: the same greedy tokens, for an attention-only model and a
hybrid; steps with a tool-call row beside speculating rows ran static; the padded rows' unkept drafts
are not counted as drafted; KV invariants hold after every step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from policies.policy import SpeculationPolicy
from specialists.engine import Engine
from specialists.sampling import SamplingParams
from tests.test_decode_ahead import CUDA, DEV, ROOT, _prompts


def _engine(domain: str, mode: str) -> Engine:
    flags = {"cuda_graphs": True} if CUDA else {"static_batches": True, "pad_batches": True}
    return Engine.from_pretrained(ROOT / "deploy" / "models" / domain, device=DEV, dtype=torch.float32, max_num_seqs=4,
                                  num_blocks=256, policy=SpeculationPolicy(mode=mode, num_speculative_tokens=3), **flags)


@pytest.mark.parametrize("domain", ["shell", "cpp"])
def test_a_tool_call_row_among_speculating_rows_keeps_the_step_static(domain: str) -> None:
    ref, eng = _engine(domain, "off"), _engine(domain, "on")
    prompts = _prompts(eng, domain, 3)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    first = ref.generate(prompts[:1], params)[0].token_ids
    tag = [t for i, t in enumerate(first) if i >= 8 and t not in first[:i] + sum(prompts, [])][0]  # opens r0's call mid-run
    for e in (ref, eng):
        e.triggers = replace(e.triggers, tool_open_id=tag)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    for i, p in enumerate(prompts):
        eng.add_request(p, params, f"r{i}")
    mixed = static_mixed = 0
    got: dict[str, list[int]] = {}
    drafted_in_tool: dict[str, int] = {}  # a sequence's drafted count when its tool call opened
    while eng.has_unfinished():
        running = list(eng.scheduler.running)
        tool = any(s.in_tool for s in running) and any(not s.in_tool and s.draft_ok for s in running)
        before = eng.runner.static_steps
        for o in eng.step():
            got[o.request_id] = list(o.token_ids)
            seq = eng._seqs.get(o.request_id)
            if seq is not None and seq.in_tool:
                drafted_in_tool.setdefault(o.request_id, seq.stats.drafted)
                assert seq.stats.drafted == drafted_in_tool[o.request_id]  # its unkept drafts are not counted
        eng.kv.check_invariants()
        if tool and not eng.scheduler.waiting:
            mixed += 1
            static_mixed += eng.runner.static_steps - before
    assert [got[f"r{i}"] for i in range(3)] == want
    assert tag in want[0] and "r0" in drafted_in_tool
    assert mixed >= 3 and static_mixed == mixed, (mixed, static_mixed)
    assert eng.totals.as_dict()["drafted"] > 0
