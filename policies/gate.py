"""The runtime gate: whether the next engine step speculates, under a policy that can change live.

mode "on" -> "on", "off" -> "off". mode "auto" -> "on" until either the rolling acceptance
(accepted / drafted over the last ``window`` drafted tokens, judged only once ``window`` tokens were
drafted since the last reset) falls below ``min_acceptance`` (only where time does not judge, below), or the running batch exceeds
``max_running_batch``; then "fallback" for ``cooldown_s`` seconds, after which the gate probes
("on") again with a fresh window. The engine calls ``decide`` once per step and ``observe`` after
each speculative step; ``set_policy`` may come from another thread (Serve's reconfigure, the admin API).

With ``auto.min_speedup`` > 0 the gate also judges time: the engine reports every step's wall time
and emitted tokens (``observe_time``); speculative steps feed a rolling seconds-per-token figure, plain
steps (in fallback) another, both per batch-size bucket (a step with a grammar active in
another bucket than a free one of its size). Once the acceptance window is full, no plain
figure for the current bucket -> "fallback" ("baseline", to measure one); plain / speculative below
min_speedup (the median plain step's seconds per token over the mean speculative ones) -> "fallback"
("slow") for that bucket only: the verdict is kept per bucket for
``cooldown_s`` times how many times slower speculation ran (1 / speedup, at most 8x; doubled each
time a re-probe of the bucket finds it slow again, up to 8x), so a batch
that moves to a bucket where speculation pays speculates at once, and one that comes back to a slow
bucket falls back at once, without measuring again. A re-probe judges the bucket on fresh figures.
What a speculating prefill step spends on the drafter's pass over its prompts is charged to the
bucket's next timed speculative step (``charge``; a CPU engine's, where that time is wall time).
A paired gate (a CPU engine's: the drafter entries its plain steps skip are caught up on resume,
spec/catchup.py) takes a bucket's first plain figure before the bucket's first speculative step, so a
losing bucket never speculates past its window. A baseline's end judges a bucket with both figures
(a GPU's bucket speculates first: a losing one gets its verdict without a second window). A CPU
engine reports no step within SETTLE_STEPS of a prefill, and while a slow verdict holds one in HELD_EVERY.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from policies.figures import GateInputError, RollingAcceptance, SecondsPerToken
from policies.policy import SpeculationPolicy

Status = Literal["on", "off", "fallback"]
Reason = Literal["policy", "probe", "low_acceptance", "large_batch", "baseline", "slow"]

log = logging.getLogger(__name__)


# speculative seconds per token over this many steps: acceptance swings with the text (a stretch of a
# few dozen steps where drafts miss is common), so a short window judged batch 1 slow mid-request while
# it ran 1.2x faster over the whole (general, HumanEval, 2026-11-26); the first judgement of a bucket
# still comes after a few steps (the window is only as long as what was measured)
SPEC_STEPS = 256
# a bucket that keeps speculating measures plain decoding again (a baseline of baseline_steps) after
# this many speculative steps: a plain figure taken once, right after a prefill (slower steps while
# the caches refill), kept build's batch 8 speculating at 0.82-0.89x (2026-11-26); ~3% of the steps
REFRESH_EVERY = 256
# the first refresh of a bucket's plain figure comes after this many speculative steps, each next one
# after twice as many, up to REFRESH_EVERY: a baseline is a few steps, and one taken in a stall (python,
# H100, batch 1: plain steps read 10x slower than those around them, s22) kept a losing bucket
# speculating at 0.67x for a whole run; now such a verdict lasts 32 steps. Not for a paired gate (a
# CPU's): its baselines cost the drafter's catch-up on resume, and the early refreshes cost cpp's
# winning buckets ~1% (b1 1.531, 1.559 against 1.594, 1.563; b8 1.301, 1.271 against 1.299, 1.291)
REFRESH_FIRST = 32
# no step time is reported within this many steps of a prefill: those run up to 2x slower (caches refill;
# build b8 CPU 1.86, 1.29, 1.05, then 0.9 ms), and a baseline taken there judged build's b8 faster speculating
SETTLE_STEPS = 3
# a bucket is judged slow below min_speedup x (1 - SLOW_MARGIN / sqrt(its speculative steps)): a figure of
# a few steps is noisy (a speculative step's tokens vary 1..K+1), and a slow verdict holds cooldown_s or
# more. python's free replies at batch 1 (CPU) were judged slow at 0.99 after 22 steps and at 0.75
# after 9 where speculation ran 1.27x faster over the run (s18); a bucket at 0.35-0.6 (the toys at batch
# 8 on an H100) is still judged slow within its first window (the margin is 0.35 at 2 steps, 0.06 at 64)
SLOW_MARGIN = 0.5
HELD_EVERY = 8  # a held slow verdict: one plain step in 8 timed (~8 us of bookkeeping a step, ~1% at CPU b8)


def _cooldown(base: float, speedup: float, last: float | None) -> float:
    """A slow verdict's length: base x 1 / speedup (a probe of a bucket where speculation ran at 0.1x
    costs ten times what one at 0.9x costs, so it comes ten times less often: the toys' batch 8 on
    an H100 ran at 0.08-0.56x and re-probed every 10 s, ~half of `auto`'s 6% loss on cpp, s22), and
    twice the last one after a re-probe judged slow again; at most 8 x base."""
    first = base * min(8.0, 1.0 / max(speedup, 1e-9))
    return min(8 * base, first if last is None else max(first, 2 * last))


def _k_options(policy: SpeculationPolicy) -> tuple[int, ...]:
    """The K values auto may run, ascending: num_speculative_tokens and auto.k_choices."""
    return tuple(sorted({policy.num_speculative_tokens, *policy.auto.k_choices}))


Bucket = tuple[int, bool]  # (1, 2, 4, 8, ... rows; a grammar active in the step)


def _bucket(batch: int, guided: bool = False) -> Bucket:
    """Steps of similar batch sizes are compared with each other, those with a grammar active apart:
    a guided plain step decodes one token (each mask needs the token before) where a free one may
    decode several in one graph, so speculation can lose free and win under a grammar (H100 toys)."""
    return 1 << max(0, batch - 1).bit_length(), guided


def _label(b: Bucket) -> int | str:  # snapshot keys: 8, or "8+grammar"
    return f"{b[0]}+grammar" if b[1] else b[0]


class SpeculationGate:
    """One specialist's speculation switch: policy + rolling acceptance + fallback timer, under a lock."""

    def __init__(self, policy: SpeculationPolicy, clock: Callable[[], float] = time.monotonic, paired: bool = False) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._policy = policy
        self._window = RollingAcceptance(policy.auto.window)
        self._status: Status = _base_status(policy)
        self.holding = False  # in a bucket's slow verdict (fallback, "slow")
        self._since = clock()
        self._reason: Reason = "policy"
        self._fallbacks = 0
        self._drafted_total = 0
        self._accepted_total = 0
        self._spec_spt: dict[Bucket, SecondsPerToken] = {}  # batch bucket -> speculative seconds per token
        self._plain_spt: dict[Bucket, SecondsPerToken] = {}  # batch bucket -> plain seconds per token
        self._k_spt: dict[tuple[Bucket, int], SecondsPerToken] = {}  # (bucket, K) -> speculative seconds per token
        self._k_steps: dict[Bucket, int] = {}  # bucket -> steps that asked k_for
        self._slow: dict[Bucket, tuple[float, float]] = {}  # bucket -> (slow until, the cooldown it got)
        self._reprobe: dict[Bucket, float] = {}  # bucket -> the cooldown of its expired slow verdict
        self._since_plain: dict[Bucket, int] = {}  # bucket -> speculative steps since its plain figure was taken
        self._refresh: dict[Bucket, int] = {}  # bucket -> speculative steps until its next refresh (REFRESH_FIRST..EVERY)
        self._charged: dict[Bucket, float] = {}  # bucket -> seconds speculation cost outside timed steps (charge)
        # paired: a CPU engine's gate (its plain steps owe the drafter's entries, caught up on resume; not with
        # multi-step graphs): a bucket's plain figure comes first
        self.paired = paired
        self._timed = False  # the engine reports step times (observe_time): a bucket's plain figure comes first

    @property
    def policy(self) -> SpeculationPolicy:
        return self._policy

    def set_policy(self, policy: SpeculationPolicy, fresh: bool = False) -> None:
        """Switch now: the next decide() follows the new policy; the window starts afresh. The time
        figures and the buckets' verdicts too with fresh (Engine.warmup's steps are not what serving
        costs) or a policy that differs in more than its mode (other K, thresholds: other figures);
        a toggle of the mode alone keeps them, as what this machine measured."""
        with self._lock:
            old = self._policy
            self._policy = policy
            self._window = RollingAcceptance(policy.auto.window)
            if fresh or policy.model_copy(update={"mode": old.mode}) != old:
                for figures in (self._spec_spt, self._plain_spt, self._k_spt, self._k_steps, self._slow, self._reprobe,
                                self._since_plain, self._charged, self._refresh):
                    figures.clear()
            self._enter(_base_status(policy), "policy")
            status = self._status
        log.info("speculation policy: mode %s -> %s, status %s", old.mode, policy.mode, status)

    def decide(self, running_batch: int, guided: bool = False) -> Status:
        """The status for this engine step (guided: a grammar active in it); called once per step, before drafting."""
        with self._lock:
            if self._policy.mode != "auto":
                return self._status
            gating = self._policy.auto
            b = _bucket(running_batch, guided)
            slow = self._bucket_slow(b)
            if self._status == "fallback":
                if self._reason == "slow" and slow:
                    return "fallback"
                if self._reason != "slow" and not self._fallback_over(gating, b):
                    return "fallback"
                if self._reason == "baseline" and self._judge(b):
                    return "fallback"
                self._window = RollingAcceptance(gating.window)
                self._enter("on", "probe")
            if running_batch > gating.max_running_batch:
                self._fall_back("large_batch")
            elif slow and self._status == "on":  # back in a bucket judged slow: no need to measure again
                self._enter("fallback", "slow")
            elif self._status == "on" and self._plain_first(b):
                self._fall_back("baseline")
            return self._status

    def _plain_first(self, b: Bucket) -> bool:  # under the lock
        """Whether bucket b takes its plain figure now, before its first speculative step: a paired
        gate (its baseline steps owe the drafter entries that the catch-up writes on resume), the
        time gate on, the engine timing its steps, and b with neither figure. Taken first, the plain
        steps run as plain steps do in serving; paired with speculative steps they ran 10-15% slower
        (right after a verify), which kept build's batch 8 speculating at 0.8x. A GPU's multi-step graphs
        (not paired) keep no per-token hidden states, so nothing catches the drafter up after a plain
        stretch, and plain-first cost cpp and python 12% at batch 8 (bench/RESULTS.md)."""
        return (self.paired and self._timed and self._policy.auto.min_speedup > 0 and b not in self._plain_spt
                and b not in self._spec_spt)

    def _bucket_slow(self, b: Bucket) -> bool:  # under the lock
        """Whether bucket b's slow verdict holds now; an expired one is dropped with the bucket's
        speculative figures (the re-probe judges fresh ones) and remembered for the backoff."""
        entry = self._slow.get(b)
        if entry is None:
            return False
        if self._clock() < entry[0]:
            return True
        del self._slow[b]
        self._reprobe[b] = entry[1]
        self._spec_spt.pop(b, None)
        for key in [key for key in self._k_spt if key[0] == b]:  # each K measured afresh too
            del self._k_spt[key]
        return False

    def observe(self, drafted: int, accepted: int) -> None:
        """Counts of one speculative step, summed over its sequences (after trigger truncation)."""
        if drafted < 0 or not 0 <= accepted <= drafted:
            raise GateInputError(f"need 0 <= accepted <= drafted, got drafted={drafted} accepted={accepted}")
        with self._lock:
            self._drafted_total += drafted
            self._accepted_total += accepted
            if self._status == "off" or self._status == "fallback":
                return  # a step decided before a switch; nothing to judge
            self._window.add(drafted, accepted)
            if self._policy.mode != "auto" or not self._window.full:
                return
            rate = self._window.rate
            if rate is not None and rate < self._policy.auto.min_acceptance and not self._time_judges():
                self._fall_back("low_acceptance")

    def _time_judges(self) -> bool:  # under the lock
        """Whether time judges this gate (min_speedup > 0 and the engine reports step times): then a low
        rolling acceptance is no verdict of its own. The figure that matters is seconds per token, and a
        window of poor drafts (free JSON text, python: 0.27-0.30 acceptance dipping under 0.1) held a
        whole cooldown_s without speculation where it ran 1.27x faster (bench.tool_validity, CPU, s18)."""
        return self._timed and self._policy.auto.min_speedup > 0

    def k_for(self, batch: int, guided: bool = False) -> int:
        """K for a speculative step at this batch size: num_speculative_tokens, or with auto.k_choices
        the fastest measured K of this batch's bucket (each tried probe_steps steps first; every
        probe_every steps one step tries the next K in turn, so a change of load is noticed)."""
        with self._lock:
            p = self._policy
            choices = _k_options(p)
            if p.mode != "auto" or len(choices) == 1:
                return p.num_speculative_tokens
            b = _bucket(batch, guided)
            n = self._k_steps[b] = self._k_steps.get(b, 0) + 1
            fresh = [k for k in choices if (s := self._k_spt.get((b, k))) is None or s.count < p.auto.probe_steps]
            if fresh:
                return fresh[0]
            if n % p.auto.probe_every == 0:
                return choices[(n // p.auto.probe_every) % len(choices)]
            return min(choices, key=lambda k: self._k_spt[(b, k)].value)

    def observe_time(self, status: Status, batch: int, seconds: float, tokens: int, k: int | None = None,
                     guided: bool = False) -> None:
        """One engine step's wall time and emitted tokens, with the status it was decided under (and
        the K its speculative rows verified)."""
        if seconds < 0 or tokens < 0:
            raise GateInputError(f"need seconds >= 0 and tokens >= 0, got {seconds}, {tokens}")
        with self._lock:
            self._timed = True
            b = _bucket(batch, guided)
            if status == "on":
                seconds += self._charged.pop(b, 0.0)
                self._spec_spt.setdefault(b, SecondsPerToken(SPEC_STEPS)).add(seconds, tokens)
                self._since_plain[b] = self._since_plain.get(b, 0) + 1
                if k:
                    self._k_spt.setdefault((b, k), SecondsPerToken()).add(seconds, tokens)
            else:
                self._plain_spt.setdefault(b, SecondsPerToken()).add(seconds, tokens)
                self._since_plain[b] = 0
            gating = self._policy.auto
            if self._policy.mode != "auto" or gating.min_speedup <= 0 or status != "on" or self._status != "on":
                return
            if not self._window.full:
                return
            plain = self._plain_spt.get(b)
            due = self._refresh.get(b, REFRESH_EVERY if self.paired else REFRESH_FIRST)
            if plain is None or plain.value is None or self._since_plain.get(b, 0) >= due:
                if plain is not None:  # a refresh: the next one comes twice as late
                    self._refresh[b] = min(REFRESH_EVERY, 2 * due)
                self._plain_spt.pop(b, None)  # a fresh plain figure, taken now
                self._fall_back("baseline")
                return
            self._judge(b)

    def charge(self, batch: int, seconds: float, guided: bool = False) -> None:
        """Seconds a speculating step spent that no timed step shows and plain decoding does not spend: the
        drafter's pass over new prompts (a prefill step is not timed). Added to the bucket's next timed
        speculative step. Without it the figure left out a cost every speculated request pays: at batch
        8 (CPU, K=3) build's and shell's `auto` read 0.934-0.955x plain without it, 0.967-0.986x with it,
        cpp unchanged at 1.25-1.28x (session 21)."""
        if seconds < 0:
            raise GateInputError(f"need seconds >= 0, got {seconds}")
        with self._lock:
            b = _bucket(batch, guided)
            self._charged[b] = self._charged.get(b, 0.0) + seconds

    def _judge(self, b: Bucket) -> bool:  # under the lock
        """Bucket b's verdict from its figures: slow -> fallback for the bucket's cooldown. -> slow?"""
        gating = self._policy.auto
        speedup = self._speedup(b)
        steps = self._spec_spt[b].count if b in self._spec_spt else 0
        if speedup is not None and speedup < gating.min_speedup * (1 - SLOW_MARGIN / max(1, steps) ** 0.5):
            last = self._reprobe.pop(b, None)  # slow again after a re-probe: wait twice as long
            cooldown = _cooldown(gating.cooldown_s, speedup, last)
            self._slow[b] = (self._clock() + cooldown, cooldown)
            self._fall_back("slow")
            return True
        if speedup is not None and speedup >= gating.min_speedup:  # judged fast: a later slow verdict starts the
            self._reprobe.pop(b, None)  # backoff afresh (a figure still inside the margin is no such judgement:
        return False  # clearing it there kept build's b8 re-probing every 10 s, CPU, s19)

    def speedup(self, batch: int = 1, guided: bool = False) -> float | None:  # plain over speculative s/token at batch's bucket
        with self._lock:
            return self._speedup(_bucket(batch, guided))

    def _speedup(self, b: Bucket) -> float | None:  # under the lock
        """With k_choices, of the K that k_for runs (the fastest measured): every K's probe steps
        mixed judged a bucket slow where one K was twice as fast as plain."""
        plain, spec = self._plain_spt.get(b), self._spec_spt.get(b)
        if plain is None or spec is None or not plain.median or not spec.value:
            return None
        p = self._policy
        best = [v for (bk, _), s in self._k_spt.items() if bk == b and s.count >= p.auto.probe_steps and (v := s.value)]
        several = len(_k_options(p)) > 1  # one K: its long-window figure
        return plain.median / (min(best) if several and best else spec.value)

    @property
    def reason(self) -> Reason:
        """Why the gate is in its status (a fallback's cause: baseline, slow, large_batch, ...)."""
        with self._lock:
            return self._reason

    @property
    def status(self) -> Status:
        with self._lock:
            return self._status

    @property
    def rolling_acceptance(self) -> float | None:
        """accepted/drafted over the current window (however full); None before any drafting."""
        with self._lock:
            return self._window.rate

    def snapshot(self) -> dict[str, Any]:
        """For /admin and metrics."""
        with self._lock:
            now = self._clock()
            p = self._policy
            return {
                "mode": p.mode,
                "status": self._status,
                "reason": self._reason,
                "since": self._since,
                "seconds_in_status": now - self._since,
                "probe_in_s": max(0.0, self._since + p.auto.cooldown_s - now) if self._status == "fallback" else None,
                "rolling_acceptance": self._window.rate,
                "window_drafted": self._window.drafted,
                "window": p.auto.window,
                "fallbacks": self._fallbacks,
                "drafted_total": self._drafted_total,
                "accepted_total": self._accepted_total,
                "num_speculative_tokens": p.num_speculative_tokens,
                "acceptance": p.acceptance,
                "measured_speedup": {_label(b): round(v, 3) for b in self._spec_spt if (v := self._speedup(b)) is not None},
                "slow_buckets": {_label(b): round(max(0.0, until - now), 3) for b, (until, _) in sorted(self._slow.items())},
                "seconds_per_token_by_k": {f"{_label(b)}:{k}": round(v, 6) for (b, k), s in sorted(self._k_spt.items())
                                           if (v := s.value) is not None},
            }

    def _fallback_over(self, gating: Any, b: Bucket) -> bool:  # under the lock
        """A baseline fallback ends once baseline_steps plain steps of this batch's bucket were timed;
        any other (but "slow", kept per bucket) after cooldown_s."""
        if self._reason == "baseline":
            plain = self._plain_spt.get(b)
            return plain is not None and plain.count >= gating.baseline_steps
        return self._clock() - self._since >= gating.cooldown_s

    def _fall_back(self, reason: Reason) -> None:  # under the lock
        self._fallbacks += 1
        log.info("speculation fallback (%s), rolling acceptance %s", reason, self._window.rate)
        self._enter("fallback", reason)

    def _enter(self, status: Status, reason: Reason) -> None:  # under the lock
        self.holding = status == "fallback" and reason == "slow"  # read without the lock (one bool)
        self._status = status
        self._reason = reason
        self._since = self._clock()


def _base_status(policy: SpeculationPolicy) -> Status:
    return "off" if policy.mode == "off" else "on"
