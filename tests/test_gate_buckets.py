"""The auto gate's time judgement per batch-size bucket (policies/gate.py): slow verdicts kept per
bucket, with a backoff on re-probes."""

from __future__ import annotations

import pytest

from policies.gate import SpeculationGate
from test_policies import Clock, auto_policy, timed_steps


def test_slow_verdicts_are_kept_per_bucket_with_a_backoff() -> None:
    """Batch 8 loses (0.6 s a step for 3 tokens against 0.1 s a token), batch 1 wins (0.25 s): a
    batch that drops to 1 speculates at once, one that comes back to 8 falls back at once, without
    measuring again. Its verdict holds cooldown_s / 0.5 (the slower speculation ran, the rarer the
    probes); a re-probe of bucket 8 after it judges fresh figures and, slow again, keeps the bucket in
    fallback twice as long."""
    clock = Clock()
    gate = SpeculationGate(auto_policy(min_acceptance=0.1, window=6, min_speedup=1.0, max_running_batch=16,
                                       cooldown_s=10.0, baseline_steps=4), clock)
    for batch, spec_s in ((1, 0.25), (8, 0.6)):  # each bucket: window, baseline, probe, verdict
        timed_steps(gate, 20, spec_s=spec_s, plain_s=0.1, batch=batch)
    assert gate.status == "fallback" and gate.snapshot()["reason"] == "slow"
    assert gate.snapshot()["slow_buckets"] == {8: 20.0}
    assert timed_steps(gate, 3, spec_s=0.25, plain_s=0.1, batch=1) == ["on"] * 3  # no cooldown to wait for
    assert timed_steps(gate, 2, spec_s=0.6, plain_s=0.1, batch=8) == ["fallback"] * 2  # known slow
    clock.now += 20.5
    seen = timed_steps(gate, 4, spec_s=0.6, plain_s=0.1, batch=8)
    assert seen[0] == "on" and seen[-1] == "fallback"  # re-probed, judged slow again on its own figures
    assert gate.snapshot()["slow_buckets"] == {8: 40.0}
    clock.now += 30
    assert gate.decide(8) == "fallback"  # still inside the doubled cooldown
    assert gate.decide(1) == "on"


def test_fresh_policy_judges_afresh_and_a_toggle_keeps_what_was_measured() -> None:
    """set_policy(fresh=True) (Engine.warmup ends with one) drops the buckets' figures and verdicts:
    what warm-up steps cost is not what serving costs. A plain toggle (off, then auto again) keeps them."""
    clock = Clock()
    policy = auto_policy(min_acceptance=0.1, window=6, min_speedup=1.0, max_running_batch=16, baseline_steps=4)
    gate = SpeculationGate(policy, clock)
    timed_steps(gate, 20, spec_s=0.6, plain_s=0.1, batch=8)
    assert gate.snapshot()["slow_buckets"] == {8: 20.0} and gate.speedup(8) is not None
    gate.set_policy(policy.model_copy(update={"mode": "off"}))
    gate.set_policy(policy)
    assert gate.snapshot()["slow_buckets"] == {8: 20.0} and gate.decide(8) == "fallback"
    gate.set_policy(policy, fresh=True)
    assert gate.snapshot()["slow_buckets"] == {} and gate.speedup(8) is None
    assert gate.decide(8) == "on"  # not paired (a GPU's): speculates first, as the drafter is current then
    timed_steps(gate, 20, spec_s=0.6, plain_s=0.1, batch=8)
    assert gate.snapshot()["slow_buckets"] == {8: 20.0}
    gate.set_policy(policy.model_copy(update={"num_speculative_tokens": 2}))  # another policy: other figures
    assert gate.snapshot()["slow_buckets"] == {} and gate.decide(8) == "on"


def test_a_new_bucket_is_measured_plain_first_and_judged_on_the_median_plain_step() -> None:
    """A paired gate (a CPU's, whose baseline steps owe the drafter's entries): once the engine times its
    steps, a bucket with no figures starts with its baseline: plain steps only (not paired with
    speculative ones, whose neighbours ran slower), then speculates and is judged on the median plain
    step, which one slow step after a switch does not move. A losing bucket thus never speculates past
    its window; a winning one speculates after baseline_steps plain steps."""
    policy = auto_policy(min_acceptance=0.1, window=6, min_speedup=1.0, max_running_batch=16, baseline_steps=4)
    gate = SpeculationGate(policy, Clock(), paired=True)
    assert timed_steps(gate, 1, spec_s=0.25, plain_s=0.1, batch=1) == ["on"]  # nothing timed yet: as before
    seen = timed_steps(gate, 4, spec_s=0.6, plain_s=0.1, batch=8)
    assert seen == ["fallback"] * 4 and gate.reason == "baseline"  # not paired: plain steps only
    seen = timed_steps(gate, 4, spec_s=0.6, plain_s=0.1, batch=8)
    assert seen == ["on", "on", "fallback", "fallback"] and gate.reason == "slow"  # judged once the window is full
    assert gate.speedup(8) == pytest.approx(0.1 / 0.2)
    gate.observe_time("fallback", 8, 5.0, 1)  # one slow plain step: the median keeps the figure
    assert gate.speedup(8) == pytest.approx(0.1 / 0.2)
    assert timed_steps(gate, 2, spec_s=0.1, plain_s=0.1, batch=2) == ["fallback"] * 2  # a new bucket: plain first


def test_a_paired_baseline_is_plain_and_judged_at_its_end() -> None:
    """A CPU's baseline (paired) is plain steps only: it used to alternate plain and speculative steps,
    but a plain step owes the drafter its entries, so the speculative step after it could not draft.
    Its end judges at once on the bucket's speculative figure; a batch above max_running_batch
    meanwhile decodes plainly."""
    gate = SpeculationGate(auto_policy(min_acceptance=0.1, window=6, min_speedup=1.0, max_running_batch=8,
                                       baseline_steps=4), Clock(), paired=True)
    seen = timed_steps(gate, 2, spec_s=0.6, plain_s=0.1, batch=8)
    assert seen == ["on", "on"] and gate.snapshot()["reason"] == "baseline"  # window full, no plain figure
    assert timed_steps(gate, 4, spec_s=0.6, plain_s=0.1, batch=8) == ["fallback"] * 4
    assert gate.decide(16) == "fallback"
    assert timed_steps(gate, 1, spec_s=0.6, plain_s=0.1, batch=8) == ["fallback"]
    assert gate.snapshot()["reason"] == "slow" and gate.snapshot()["slow_buckets"] == {8: 20.0}  # 0.5x: 2 x cooldown_s


def test_an_unpaired_bucket_is_judged_at_its_baselines_end() -> None:
    """A GPU's gate (not paired) speculates first: its window (2 steps of 3 drafts), then the baseline
    (4 plain steps), then the verdict at once: a losing bucket speculates no more (no second window),
    a winning one goes on."""
    for spec_s, verdict in ((0.6, "fallback"), (0.25, "on")):
        gate = SpeculationGate(auto_policy(min_acceptance=0.1, window=6, min_speedup=1.0, max_running_batch=16,
                                           baseline_steps=4), Clock())
        seen = timed_steps(gate, 12, spec_s=spec_s, plain_s=0.1, batch=8)
        assert seen[:6] == ["on"] * 2 + ["fallback"] * 4 and seen[6:] == [verdict] * 6
        assert gate.snapshot()["reason"] == ("slow" if verdict == "fallback" else "probe")


def test_the_engine_times_settled_steps_and_one_in_eight_while_a_verdict_holds() -> None:
    """The engine reports no step time within SETTLE_STEPS of a prefill (the caches refill there:
    a baseline taken there judged a losing batch faster speculating), and while a slow verdict holds
    only one plain step in HELD_EVERY (the plain figure stays current at an eighth of the bookkeeping).
    A GPU's gate (not paired) has no settle, but a step that prefills is never timed either."""
    from pathlib import Path

    from specialists.engine import Engine
    from specialists.sampling import SamplingParams
    from policies.gate import HELD_EVERY, SETTLE_STEPS

    shell = Path(__file__).resolve().parents[1] / "deploy" / "models" / "shell"
    eng = Engine.from_pretrained(shell, max_num_seqs=2, num_blocks=64,
                                 policy=auto_policy(min_acceptance=0.0, min_speedup=1.0, window=1000))
    timed, observe = [], eng.gate.observe_time
    eng.gate.observe_time = lambda status, *a, **k: (timed.append((eng.steps, status)), observe(status, *a, **k))
    eng.add_request(eng.tokenizer("ls -la", add_special_tokens=False)["input_ids"],
                    SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(20):
        eng.step()
    assert timed and min(s for s, _ in timed) == SETTLE_STEPS  # the prefill was step 0
    with eng.gate._lock:  # a slow verdict for every bucket, held
        eng.gate._slow.update({(b, False): (1e12, 1e12) for b in (1, 2, 4)})
        eng.gate._enter("fallback", "slow")
    timed.clear()
    emitted_before = sum(v["tokens"] for v in eng.metrics()["step_times"].values())
    for _ in range(24):
        eng.step()
    assert [st for _, st in timed] == ["fallback"] * 3 and all(s % HELD_EVERY == 0 for s, _ in timed)
    step_times = eng.metrics()["step_times"]  # every step by what the gate decided: the held ones as such
    assert step_times["fallback:slow"]["steps"] == 24 and step_times["fallback:slow"]["tokens"] == 24
    assert sum(v["steps"] for v in step_times.values()) == eng.steps
    assert sum(v["tokens"] for v in step_times.values()) - emitted_before == 24
    eng.gate.paired = False  # a GPU's gate: no settle, but a step that prefills is never timed
    eng.gate.set_policy(eng.gate.policy, fresh=True)
    eng.step()  # speculating again: the running request drafts in the steps below
    timed.clear()
    eng.add_request(eng.tokenizer("pwd", add_special_tokens=False)["input_ids"], SamplingParams(max_tokens=8))
    prefill_step = eng.steps
    eng.step()
    eng.step()
    assert [s for s, _ in timed] == [prefill_step + 1]


def test_steps_with_a_grammar_are_judged_apart_from_free_ones() -> None:
    """A free plain step may decode several tokens in one graph (a GPU's) where a guided one decodes
    one (each mask needs the token before): on an H100 the toys' speculation loses free and wins under
    a grammar. Here free speculation runs at 0.5x (0.2 s a token against 0.1) and guided at 2x (0.2
    against 0.4): each kind gets its own verdict at the same batch size, and keeps it when they alternate."""
    gate = SpeculationGate(auto_policy(min_acceptance=0.1, window=6, min_speedup=1.0, baseline_steps=4), Clock())
    timed_steps(gate, 20, spec_s=0.6, plain_s=0.1)
    assert gate.snapshot()["slow_buckets"] == {1: 20.0}
    assert timed_steps(gate, 20, spec_s=0.6, plain_s=0.4, guided=True)[-10:] == ["on"] * 10
    snap = gate.snapshot()
    assert snap["slow_buckets"] == {1: 20.0} and snap["measured_speedup"]["1+grammar"] == pytest.approx(2.0)
    for _ in range(5):
        assert timed_steps(gate, 1, spec_s=0.6, plain_s=0.1) == ["fallback"]
        assert timed_steps(gate, 1, spec_s=0.6, plain_s=0.4, guided=True) == ["on"]
    assert gate.speedup(1) == pytest.approx(0.5) and gate.speedup(1, guided=True) == pytest.approx(2.0)


def test_the_engine_tells_the_gate_which_steps_a_grammar_guides() -> None:
    """Engine.step passes the gate whether a grammar is active in the step (a running or admitted
    sequence's), so that guided and free steps are judged apart."""
    from pathlib import Path

    from specialists.engine import Engine
    from specialists.sampling import SamplingParams
    from specialists.wire import GrammarSpec

    shell = Path(__file__).resolve().parents[1] / "deploy" / "models" / "shell"
    eng = Engine.from_pretrained(shell, max_num_seqs=2, num_blocks=64, policy=auto_policy(min_acceptance=0.0))
    seen, decide = [], eng.gate.decide
    eng.gate.decide = lambda batch, guided=False: (seen.append(guided), decide(batch, guided))[1]
    ids = eng.tokenizer("list the files", add_special_tokens=False)["input_ids"]
    eng.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(seen) >= 4 and not any(seen)
    seen.clear()
    eng.generate([ids], SamplingParams(max_tokens=12, grammar=eng.grammar(GrammarSpec(kind="json_object"))))
    assert len(seen) >= 2 and all(seen)


def test_under_the_time_gate_a_window_of_poor_drafts_is_no_verdict() -> None:
    """With the time gate on and step times reported, a rolling acceptance under min_acceptance does not
    stop speculation for a cooldown: seconds per token judge (here speculation runs 0.15 s a token
    against 0.2 plain, with 1 draft in 5 kept). With min_speedup 0 the floor still falls back."""
    def run(min_speedup: float) -> list[str]:
        gate = SpeculationGate(auto_policy(min_acceptance=0.5, window=6, min_speedup=min_speedup, baseline_steps=4), Clock())
        seen = []
        for _ in range(30):
            status = gate.decide(1)
            seen.append(status)
            if status == "on":
                gate.observe(5, 1)
                gate.observe_time("on", 1, 0.3, 2)
            else:
                gate.observe_time(status, 1, 0.2, 1)
        return seen
    timed = run(1.0)
    assert timed[-10:] == ["on"] * 10 and "fallback" in timed  # its baseline, then speculating on
    assert run(0.0)[-10:] == ["fallback"] * 10  # acceptance alone: the floor holds for cooldown_s


def test_a_slow_verdict_waits_for_evidence_in_proportion_to_the_loss() -> None:
    """A bucket is judged slow below min_speedup x (1 - SLOW_MARGIN / sqrt(speculative steps)): at 0.5x
    the first judgement (2 speculative steps) says slow; at 0.9x speculation goes on until ~26 steps
    make the figure trustworthy (a few steps' tokens vary 1..K+1, and a verdict holds cooldown_s)."""
    from policies.gate import SLOW_MARGIN

    def first_slow(spec_s: float) -> int:
        gate = SpeculationGate(auto_policy(min_acceptance=0.1, window=6, min_speedup=1.0, baseline_steps=4), Clock())
        seen = timed_steps(gate, 60, spec_s=spec_s, plain_s=0.1)
        assert gate.snapshot()["slow_buckets"][1] == pytest.approx(10.0 / gate.speedup(1), abs=0.01)
        return seen[:seen.index("fallback", 6)].count("on")  # speculative steps before the verdict

    assert first_slow(0.6) == 2  # 0.5x: at the baseline's end
    n = first_slow(1 / 3)  # 0.9x
    assert (1 - SLOW_MARGIN / n ** 0.5) > 0.9 >= (1 - SLOW_MARGIN / (n - 1) ** 0.5) and 20 <= n <= 30


def test_the_backoff_survives_a_reprobe_that_takes_several_steps_to_judge() -> None:
    """A bucket that loses by little (0.85x) is judged slow only after several speculative steps (the
    margin shrinks with their number); the judgements before, inside the margin, are no verdict that
    it pays, so its re-probes still back off: 10 / 0.85, then twice that, up to 8 x 10 s. (They cleared the backoff: build's batch
    8 on the CPU re-probed every 10 s, each re-probe paying the drafter's catch-up.)"""
    clock = Clock()
    gate = SpeculationGate(auto_policy(min_acceptance=0.1, window=6, min_speedup=1.0, max_running_batch=16,
                                       cooldown_s=10.0, baseline_steps=4), clock)
    spec_s = 3 * 0.1 / 0.85  # 3 tokens a step at 0.85x plain's 0.1 s a token
    cooldowns = []
    for _ in range(4):
        seen = timed_steps(gate, 200, spec_s=spec_s, plain_s=0.1, batch=8)
        assert seen[-1] == "fallback" and gate.reason == "slow"
        assert seen.count("on") > 6  # not judged within its first window: a margin of evidence first
        cooldowns.append(gate.snapshot()["slow_buckets"][8])
        clock.now += cooldowns[-1] + 0.5
    assert cooldowns == [11.765, 23.529, 47.059, 80.0]
    # a re-probe that finds the bucket paying clears the backoff
    timed_steps(gate, 40, spec_s=0.25, plain_s=0.1, batch=8)
    assert gate.status == "on" and gate.snapshot()["slow_buckets"] == {}
    clock.now += 1
    timed_steps(gate, 200, spec_s=spec_s, plain_s=0.1, batch=8)
    assert gate.snapshot()["slow_buckets"][8] == pytest.approx(10.0 / gate.speedup(8), abs=0.01)  # afresh: no doubling


def test_a_charged_prefill_cost_counts_against_speculation() -> None:
    """The drafter's pass over new prompts is spent on a prefill step, which no figure times: charged,
    it joins the bucket's next speculative step. A bucket whose decode steps alone run 1.2x plain
    (0.25 s for 3 tokens against 0.1 a token) keeps speculating; with 0.5 s charged every 4 steps (a
    request's prompt pass) it costs 0.125 s a token all in and is judged slow."""
    policy = auto_policy(min_acceptance=0.1, window=6, min_speedup=1.0, max_running_batch=16, baseline_steps=4)
    for charge, verdict in ((0.0, "on"), (0.5, "fallback")):
        gate = SpeculationGate(policy, Clock(), paired=True)
        seen = []
        for _ in range(10):
            gate.charge(1, charge)
            seen += timed_steps(gate, 4, spec_s=0.25, plain_s=0.1, batch=1)
        slow = gate.snapshot()["slow_buckets"]
        assert bool(slow) == (verdict == "fallback"), (charge, seen)
        if verdict == "on":  # speculating but for its baselines (a refresh after REFRESH_FIRST steps)
            assert seen.count("on") >= 30 and gate.snapshot()["reason"] != "slow", seen
        else:  # a verdict of cooldown_s over the speed-up measured with the charges
            assert slow[1] == pytest.approx(10.0 / gate.speedup(1), abs=0.01) and slow[1] > 10.0, slow
    with pytest.raises(Exception):
        gate.charge(1, -1.0)


def test_a_plain_figure_taken_in_a_stall_is_measured_again_soon() -> None:
    """A bucket's baseline taken while the machine stalled (plain steps 20x their cost) judges a losing
    bucket fast; its plain figure is measured again after REFRESH_FIRST speculative steps (then after
    twice as many each time, up to REFRESH_EVERY), so the bucket falls back within ~REFRESH_FIRST steps
    instead of speculating at a loss for REFRESH_EVERY. A paired gate (a CPU's: a baseline costs the
    drafter's catch-up) refreshes every REFRESH_EVERY steps from the start."""
    from policies.gate import REFRESH_EVERY, REFRESH_FIRST

    clock = Clock()
    gate = SpeculationGate(auto_policy(min_acceptance=0.1, window=6, min_speedup=1.0, baseline_steps=4), clock)
    seen = timed_steps(gate, 8, spec_s=0.5, plain_s=2.0)  # window, baseline in the stall, judged fast
    assert seen[-1] == "on" and gate.speedup(1) > 5
    seen = timed_steps(gate, REFRESH_FIRST + 12, spec_s=0.5, plain_s=0.1)  # 0.6x of plain in truth
    assert seen[-1] == "fallback" and gate.snapshot()["reason"] == "slow"
    assert seen.count("on") <= REFRESH_FIRST + 2

    winning = SpeculationGate(auto_policy(min_acceptance=0.1, window=6, min_speedup=1.0, baseline_steps=4), clock)
    seen = timed_steps(winning, 1200, spec_s=0.2, plain_s=0.1)  # 1.5x: speculates, refreshing now and then
    runs, n = [], 0  # speculative steps between baselines
    for status in seen:
        if status == "on":
            n += 1
        elif n:
            runs.append(n)
            n = 0
    assert runs[1:5] == [REFRESH_FIRST, 2 * REFRESH_FIRST, 4 * REFRESH_FIRST, REFRESH_EVERY][:len(runs[1:5])]
    assert len(runs) >= 5 and max(runs) == REFRESH_EVERY
    paired = SpeculationGate(auto_policy(min_acceptance=0.1, window=6, min_speedup=1.0, baseline_steps=4), clock, paired=True)
    paired.observe_time("fallback", 1, 0.1, 1)  # the engine times its steps: the bucket's plain figure comes first
    seen = timed_steps(paired, 700, spec_s=0.2, plain_s=0.1)
    runs = [len(r) for r in "".join("o" if x == "on" else "." for x in seen).split(".") if r]
    assert runs[1:2] == [REFRESH_EVERY], runs
