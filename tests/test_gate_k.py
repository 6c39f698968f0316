"""auto.k_choices: K per batch-size bucket from measured time, and the time gate's verdict on the K
it would run."""

from __future__ import annotations

import pytest

from policies.gate import SpeculationGate
from tests.test_policies import Clock, auto_policy


def test_auto_picks_k_per_batch_bucket_by_measured_time() -> None:
    """auto.k_choices: each K is tried probe_steps steps per bucket, then the fastest is used, the
    others probed now and then; buckets are judged apart (batch 1 prefers K=3, batch 8 K=1 here)."""
    gate = SpeculationGate(auto_policy(min_acceptance=0.0, min_speedup=0.0, k_choices=(1, 5), probe_steps=2,
                                       probe_every=10), Clock())
    cost = {(1, 1): 0.30, (1, 3): 0.20, (1, 5): 0.25, (8, 1): 0.10, (8, 3): 0.20, (8, 5): 0.40}  # s per token

    def run(batch: int, steps: int) -> list[int]:
        picked = []
        for _ in range(steps):
            assert gate.decide(batch) == "on"
            k = gate.k_for(batch)
            picked.append(k)
            gate.observe_time("on", batch, cost[(batch, k)] * (k + 1), k + 1, k)
        return picked

    assert run(1, 6) == [1, 1, 3, 3, 5, 5]  # every K of the bucket measured first, in order
    later = run(1, 30)
    assert later.count(3) >= 27 and set(later) <= {1, 3, 5}  # the fastest, with a probe every 10 steps
    assert run(8, 6) == [1, 1, 3, 3, 5, 5] and run(8, 10).count(1) >= 9  # a new bucket: measured on its own
    snap = gate.snapshot()["seconds_per_token_by_k"]
    assert snap["1:3"] == pytest.approx(0.2) and snap["8:1"] == pytest.approx(0.1)
    plain = SpeculationGate(auto_policy(), Clock())
    assert plain.k_for(1) == 3  # without k_choices: num_speculative_tokens
    with pytest.raises(ValueError, match="k_choices"):
        auto_policy(k_choices=(0, 3))


def test_time_gate_judges_the_fastest_k_not_the_probes() -> None:
    """With k_choices the bucket is judged by the K the gate would run (the fastest measured), not by
    the mixture of every K's probe steps: K=3 twice as fast as plain keeps speculating though K=1,
    probed first, is five times slower (the mixture of the two judged the bucket slow)."""
    clock = Clock()
    gate = SpeculationGate(auto_policy(min_acceptance=0.0, window=12, min_speedup=1.0, k_choices=(1,), probe_steps=2,
                                       probe_every=50, baseline_steps=3), clock)
    cost = {1: 0.50, 3: 0.05}  # seconds per emitted token when speculating at that K; plain: 0.1
    seen = []
    for _ in range(40):
        status = gate.decide(1)
        seen.append(status)
        if status == "on":
            k = gate.k_for(1)
            gate.observe(k, k)
            gate.observe_time("on", 1, cost[k] * (k + 1), k + 1, k)
        else:
            gate.observe_time(status, 1, 0.1, 1)
    assert gate.speedup(1) == pytest.approx(0.1 / 0.05)
    assert seen[-10:] == ["on"] * 10 and gate.snapshot()["slow_buckets"] == {}


def test_one_k_is_judged_over_the_long_window() -> None:
    """Without k_choices the speculative figure stays the long one (SPEC_STEPS), not the K's last 32."""
    gate = SpeculationGate(auto_policy(min_acceptance=0.0, min_speedup=0.0), Clock())
    for _ in range(3):
        gate.observe_time("fallback", 1, 0.1, 1)
    for cost in [0.05] * 40 + [0.2] * 40:  # seconds per token, 4 tokens a step at K=3
        gate.observe_time("on", 1, cost * 4, 4, 3)
    assert gate.speedup(1) == pytest.approx(0.1 / 0.125)
