"""policies: pydantic validation, user_config parsing, and the gate driven by a hand-advanced clock."""

from __future__ import annotations

import threading

import pytest
from pydantic import ValidationError

from policies import (
    AutoGating,
    GateInputError,
    PolicySet,
    RollingAcceptance,
    SpeculationGate,
    SpeculationPolicy,
)


class Clock:
    """A clock the test advances by hand (time.monotonic's signature)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def auto_policy(**gating) -> SpeculationPolicy:
    return SpeculationPolicy(mode="auto", auto=AutoGating(**{"window": 20, "cooldown_s": 10.0, **gating}))


def drive(gate: SpeculationGate, steps: int, drafted: int, accepted: int, batch: int = 1) -> list[str]:
    """Engine-like loop: decide, and observe only when the step speculated."""
    seen = []
    for _ in range(steps):
        status = gate.decide(batch)
        seen.append(status)
        if status == "on":
            gate.observe(drafted, accepted)
    return seen


# ---------------------------------------------------------------- validation


def test_defaults() -> None:
    p = SpeculationPolicy()
    assert (p.mode, p.num_speculative_tokens, p.acceptance) == ("auto", 3, "rejection")
    assert (p.typical.epsilon, p.typical.delta) == (0.09, 0.3)
    assert (p.auto.min_acceptance, p.auto.window, p.auto.max_running_batch, p.auto.cooldown_s) == (0.1, 64, 8, 10.0)
    assert (p.auto.min_speedup, p.auto.baseline_steps) == (1.0, 8)  # the time gate judges by default


@pytest.mark.parametrize(
    "raw,where",
    [
        ({"num_speculative_tokens": 0}, ("num_speculative_tokens",)),
        ({"num_speculative_tokens": 9}, ("num_speculative_tokens",)),
        ({"mode": "maybe"}, ("mode",)),
        ({"acceptance": "eagle"}, ("acceptance",)),
        ({"speculate": True}, ("speculate",)),
        ({"typical": {"epsilon": 0.0}}, ("typical", "epsilon")),
        ({"typical": {"epsilon": 1.5}}, ("typical", "epsilon")),
        ({"typical": {"delta": -1}}, ("typical", "delta")),
        ({"typical": {"gamma": 1}}, ("typical", "gamma")),
        ({"auto": {"min_acceptance": 1.2}}, ("auto", "min_acceptance")),
        ({"auto": {"window": 0}}, ("auto", "window")),
        ({"auto": {"max_running_batch": 0}}, ("auto", "max_running_batch")),
        ({"auto": {"cooldown_s": -1}}, ("auto", "cooldown_s")),
        ({"auto": {"cooldown": 5}}, ("auto", "cooldown")),
    ],
)
def test_bad_values_rejected_with_location(raw: dict, where: tuple) -> None:
    with pytest.raises(ValidationError) as err:
        SpeculationPolicy.model_validate(raw)
    assert [e["loc"] for e in err.value.errors()] == [where]


def test_policies_are_immutable() -> None:
    p = SpeculationPolicy()
    with pytest.raises(ValidationError):
        p.mode = "off"  # type: ignore[misc]


def test_merged_is_a_validated_partial_update() -> None:
    p = SpeculationPolicy(num_speculative_tokens=4)
    q = p.merged({"mode": "on", "auto": {"cooldown_s": 2.5}})
    assert (q.mode, q.num_speculative_tokens, q.auto.cooldown_s, q.auto.window) == ("on", 4, 2.5, 64)
    assert p.mode == "auto"  # unchanged
    with pytest.raises(ValidationError):
        p.merged({"auto": {"window": -3}})


def test_user_config_round_trip_and_errors() -> None:
    p = SpeculationPolicy.from_user_config({"speculation": {"mode": "off", "typical": {"delta": 0.5}}, "max_batch": 4})
    assert p.mode == "off" and p.typical.delta == 0.5
    assert SpeculationPolicy.from_user_config(p.to_user_config()) == p
    assert SpeculationPolicy.from_user_config(None) == SpeculationPolicy()
    assert SpeculationPolicy.from_user_config({}) == SpeculationPolicy()
    with pytest.raises(ValidationError) as err:
        SpeculationPolicy.from_user_config({"speculation": {"mode": "maybe"}})
    assert err.value.errors()[0]["loc"] == ("speculation", "mode")
    with pytest.raises(ValidationError) as err:
        SpeculationPolicy.from_user_config({"speculation": {"num_speculative_tokens": 0, "bogus": 1}})
    locations = {e["loc"] for e in err.value.errors()}
    assert locations == {("speculation", "num_speculative_tokens"), ("speculation", "bogus")}


def test_policy_set_merges_overrides_over_the_default() -> None:
    ps = PolicySet.from_user_config(
        {
            "speculation": {
                "default": {"mode": "auto", "num_speculative_tokens": 4, "auto": {"window": 32}},
                "specialists": {"cpp": {"auto": {"cooldown_s": 5}}, "shell": {"mode": "off"}},
            }
        }
    )
    cpp = ps.policy_for("cpp")
    assert (cpp.mode, cpp.num_speculative_tokens, cpp.auto.window, cpp.auto.cooldown_s) == ("auto", 4, 32, 5.0)
    assert ps.policy_for("shell").mode == "off" and ps.policy_for("shell").num_speculative_tokens == 4
    assert ps.policy_for("python") == ps.default
    assert SpeculationPolicy.from_user_config(ps.user_config_for("cpp")) == cpp
    ps2 = ps.with_policy("python", SpeculationPolicy(mode="on"))
    assert ps2.policy_for("python").mode == "on" and ps.policy_for("python").mode == "auto"
    assert PolicySet.model_validate(ps2.model_dump()) == ps2  # dump of complete policies validates back


def test_policy_set_errors_name_the_specialist() -> None:
    with pytest.raises(ValidationError) as err:
        PolicySet.from_user_config({"speculation": {"specialists": {"cpp": {"num_speculative_tokens": 0}}}})
    assert err.value.errors()[0]["loc"] == ("speculation", "specialists", "cpp", "num_speculative_tokens")
    with pytest.raises(ValidationError):
        PolicySet.from_user_config({"speculation": {"defaults": {}}})
    with pytest.raises(ValidationError):
        PolicySet.from_user_config({"speculation": {"specialists": ["cpp"]}})


# ---------------------------------------------------------------- rolling window


def test_rolling_window_counts_the_last_window_tokens() -> None:
    w = RollingAcceptance(10)
    assert w.rate is None and not w.full
    w.add(6, 6)
    assert not w.full and w.rate == 1.0
    w.add(6, 0)  # the last 10 tokens: 4 of the first step (all kept), 6 of the second (none)
    assert w.full and w.drafted == 10 and w.rate == pytest.approx(0.4)
    w.add(3, 3)  # 1 of the first step, 6 of the second, 3 of the third
    assert w.rate == pytest.approx(0.4)
    w.add(25, 5)  # a step larger than the window counts at its own rate
    assert w.drafted == 10 and w.rate == pytest.approx(0.2)
    w.add(4, 1)  # 6 tokens of the 25-token step at 0.2, then 4 at 0.25
    assert w.rate == pytest.approx((6 * 0.2 + 1) / 10)
    w.add(0, 0)  # a step that drafted nothing changes nothing
    assert w.drafted == 10 and w.rate == pytest.approx(0.22)


# ---------------------------------------------------------------- the gate


def test_auto_falls_back_on_low_acceptance_only_once_the_window_is_full() -> None:
    clock = Clock()
    gate = SpeculationGate(auto_policy(min_acceptance=0.5, window=20), clock)
    assert drive(gate, 4, drafted=4, accepted=0) == ["on"] * 4  # 16 drafted < window: not judged
    assert gate.status == "on" and gate.rolling_acceptance == 0.0
    gate.decide(1)
    gate.observe(4, 0)  # 20 drafted: judged
    assert gate.status == "fallback"
    assert gate.decide(1) == "fallback"
    snap = gate.snapshot()
    assert snap["reason"] == "low_acceptance" and snap["fallbacks"] == 1 and snap["since"] == clock.now


def test_auto_stays_on_with_high_acceptance() -> None:
    gate = SpeculationGate(auto_policy(min_acceptance=0.5, window=20), Clock())
    assert drive(gate, 200, drafted=3, accepted=2) == ["on"] * 200
    assert gate.rolling_acceptance == pytest.approx(2 / 3, abs=0.05)


def test_auto_judges_the_recent_window_not_the_history() -> None:
    gate = SpeculationGate(auto_policy(min_acceptance=0.15, window=20), Clock())
    drive(gate, 100, drafted=4, accepted=4)  # long good history
    assert drive(gate, 4, drafted=4, accepted=0) == ["on"] * 4  # window: 4 kept of 20, 0.2
    assert gate.status == "on"
    gate.decide(1)
    gate.observe(4, 0)  # the last 20 tokens all rejected
    assert gate.status == "fallback"


def test_auto_falls_back_on_large_batch() -> None:
    clock = Clock()
    gate = SpeculationGate(auto_policy(max_running_batch=8), clock)
    assert gate.decide(8) == "on"
    assert gate.decide(9) == "fallback"
    assert gate.snapshot()["reason"] == "large_batch"
    clock.now += 5
    assert gate.decide(1) == "fallback"  # the cooldown holds even when the batch shrank


def test_probes_after_cooldown_with_a_fresh_window() -> None:
    clock = Clock()
    gate = SpeculationGate(auto_policy(min_acceptance=0.5, window=20, cooldown_s=10.0), clock)
    drive(gate, 5, drafted=4, accepted=0)
    assert gate.status == "fallback"
    clock.now += 9.99
    assert gate.decide(1) == "fallback"
    clock.now += 0.01
    assert gate.decide(1) == "on"
    assert gate.snapshot()["reason"] == "probe" and gate.rolling_acceptance is None  # fresh window
    # the probe is judged on its own window: bad again -> back to fallback once 20 tokens were drafted
    gate.observe(4, 0)
    assert drive(gate, 3, drafted=4, accepted=0) == ["on"] * 3
    assert gate.status == "on"
    gate.decide(1)
    gate.observe(4, 0)
    assert gate.status == "fallback" and gate.snapshot()["fallbacks"] == 2
    # a large batch at probe time falls straight back, with a new cooldown
    clock.now += 10
    assert gate.decide(50) == "fallback"
    clock.now += 9
    assert gate.decide(1) == "fallback"
    clock.now += 1
    assert gate.decide(1) == "on"


def test_set_policy_switches_immediately_and_resets_the_window() -> None:
    clock = Clock()
    gate = SpeculationGate(auto_policy(min_acceptance=0.5, window=20), clock)
    drive(gate, 5, drafted=4, accepted=0)
    assert gate.status == "fallback"
    gate.set_policy(SpeculationPolicy(mode="on"))
    assert gate.policy.mode == "on" and gate.decide(100) == "on"  # no cooldown wait
    gate.set_policy(SpeculationPolicy(mode="off"))
    assert gate.status == "off" and gate.decide(1) == "off"
    gate.observe(0, 0)
    gate.set_policy(auto_policy(min_acceptance=0.5, window=20))
    assert gate.decide(1) == "on" and gate.rolling_acceptance is None
    assert gate.snapshot()["mode"] == "auto"


@pytest.mark.parametrize("mode", ["on", "off"])
def test_on_and_off_ignore_stats_and_batch(mode: str) -> None:
    clock = Clock()
    gate = SpeculationGate(SpeculationPolicy(mode=mode, auto=AutoGating(window=4, min_acceptance=0.9)), clock)
    for _ in range(50):
        assert gate.decide(1000) == mode
        gate.observe(4, 0)
        clock.now += 100
    assert gate.status == mode and gate.snapshot()["fallbacks"] == 0


def test_observe_rejects_impossible_counts() -> None:
    gate = SpeculationGate(SpeculationPolicy(), Clock())
    with pytest.raises(GateInputError):
        gate.observe(3, 4)
    with pytest.raises(GateInputError):
        gate.observe(-1, 0)


def test_snapshot_fields() -> None:
    clock = Clock()
    gate = SpeculationGate(auto_policy(min_acceptance=0.5, window=20, cooldown_s=10.0), clock)
    drive(gate, 2, drafted=3, accepted=3)
    snap = gate.snapshot()
    assert snap["mode"] == "auto" and snap["status"] == "on" and snap["rolling_acceptance"] == 1.0
    assert snap["window_drafted"] == 6 and snap["drafted_total"] == 6 and snap["accepted_total"] == 6
    assert snap["num_speculative_tokens"] == 3 and snap["acceptance"] == "rejection" and snap["probe_in_s"] is None
    drive(gate, 5, drafted=4, accepted=0)
    clock.now += 4
    snap = gate.snapshot()
    assert snap["status"] == "fallback" and snap["probe_in_s"] == pytest.approx(6.0)
    assert snap["seconds_in_status"] == pytest.approx(4.0)


def test_set_policy_from_another_thread_while_stepping() -> None:
    """The engine steps while another thread flips the policy; every answer matches some policy and
    the final state is the last policy's."""
    gate = SpeculationGate(SpeculationPolicy(mode="on"), Clock())
    stop = threading.Event()
    seen: set[str] = set()

    def engine() -> None:
        while not stop.is_set():
            status = gate.decide(1)
            seen.add(status)
            if status == "on":
                gate.observe(3, 1)

    worker = threading.Thread(target=engine)
    worker.start()
    for i in range(200):
        gate.set_policy(SpeculationPolicy(mode="off" if i % 2 else "on"))
    gate.set_policy(SpeculationPolicy(mode="off"))
    stop.set()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert seen <= {"on", "off"} and gate.decide(1) == "off"


# ---- the time judgement (auto.min_speedup) --------------------------------------------------------------


def timed_steps(gate: SpeculationGate, steps: int, spec_s: float, plain_s: float, tokens_on: int = 3,
                batch: int = 1, guided: bool = False) -> list[str]:
    """Engine-like loop with a cost model: a speculative step takes spec_s and emits tokens_on tokens
    (all 3 drafts kept), a plain step takes plain_s and emits one (guided: a grammar active)."""
    seen = []
    for _ in range(steps):
        status = gate.decide(batch, guided)
        seen.append(status)
        if status == "on":
            gate.observe(3, tokens_on - 1)
            gate.observe_time("on", batch, spec_s, tokens_on, guided=guided)
        else:
            gate.observe_time(status, batch, plain_s, 1, guided=guided)
    return seen


def test_time_gate_is_on_by_default_and_measures_a_baseline_first() -> None:
    clock = Clock()
    acceptance_only = SpeculationGate(auto_policy(min_acceptance=0.1, window=6, min_speedup=0.0), clock)
    assert timed_steps(acceptance_only, 20, spec_s=1.0, plain_s=0.1) == ["on"] * 20  # stays on, however slow
    gate = SpeculationGate(auto_policy(min_acceptance=0.1, window=6), clock)  # the default: min_speedup 1.0
    # high acceptance, no plain figure yet: once the window is full, fall back to measure one, for
    # baseline_steps (8) plain steps of this bucket (not a cooldown: the clock does not move here)
    assert timed_steps(gate, 3, spec_s=0.25, plain_s=0.1) == ["on", "on", "fallback"]
    assert gate.snapshot()["reason"] == "baseline"
    assert timed_steps(gate, 8, spec_s=0.25, plain_s=0.1) == ["fallback"] * 7 + ["on"]  # probes after 8 plain steps
    assert gate.speedup(1) == pytest.approx(0.1 / (0.25 / 3))


@pytest.mark.parametrize("spec_s,expect", [(0.25, "on"), (0.5, "fallback")])
def test_time_gate_falls_back_only_where_speculation_loses(spec_s: float, expect: str) -> None:
    """plain: 0.1 s per token; speculative: 3 tokens per step, so 0.25 s a step wins (1.2x) and 0.5 s loses (0.6x)."""
    clock = Clock()
    gate = SpeculationGate(auto_policy(min_acceptance=0.1, window=6, min_speedup=1.0, cooldown_s=10.0, baseline_steps=6), clock)
    timed_steps(gate, 3, spec_s=spec_s, plain_s=0.1)  # -> baseline fallback (its first plain step)
    timed_steps(gate, 5, spec_s=spec_s, plain_s=0.1)  # the other 5 plain steps of the baseline
    clock.now += 10
    seen = timed_steps(gate, 6, spec_s=spec_s, plain_s=0.1)
    # the verdict comes at the baseline's end, from the window's figure: a losing bucket never
    # speculates again (no second window), a winning one goes back on
    assert seen == [expect] * 6 and gate.status == expect
    assert gate.speedup(1) == pytest.approx(0.1 / (spec_s / 3))
    if expect == "fallback":
        assert gate.snapshot()["reason"] == "slow"
    assert gate.snapshot()["measured_speedup"] == {1: round(0.1 / (spec_s / 3), 3)}


def test_time_gate_compares_like_batch_sizes() -> None:
    """A plain figure measured at batch 1 says nothing about batch 8: a new bucket needs its own baseline."""
    clock = Clock()
    gate = SpeculationGate(auto_policy(min_acceptance=0.1, window=6, min_speedup=1.0, max_running_batch=16, baseline_steps=6), clock)
    timed_steps(gate, 3, spec_s=0.25, plain_s=0.1)
    timed_steps(gate, 5, spec_s=0.25, plain_s=0.1)
    clock.now += 10
    timed_steps(gate, 6, spec_s=0.25, plain_s=0.1)
    assert gate.status == "on"
    assert timed_steps(gate, 3, spec_s=0.25, plain_s=0.1, batch=8)[-1] == "fallback"
    assert gate.snapshot()["reason"] == "baseline"
    with pytest.raises(GateInputError):
        gate.observe_time("on", 1, -1.0, 1)
