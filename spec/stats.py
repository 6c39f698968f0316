"""Speculation statistics, per request and per engine: drafted, accepted per position, mean accepted
length, rollbacks, time in draft / verify / commit. The engine exposes them for metrics and traces."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecStats:
    steps: int = 0  # engine steps that decoded (or prefilled) this request / any request
    spec_steps: int = 0  # steps that verified at least one draft
    drafted: int = 0
    accepted: int = 0  # drafts kept (after trigger truncation)
    drafted_by_position: list[int] = field(default_factory=list)  # [j]: drafts made at depth j+1
    accepted_by_position: list[int] = field(default_factory=list)  # [j]: drafts kept at depth j+1
    rollbacks: int = 0  # steps that threw away at least one draft
    emitted: int = 0  # tokens emitted
    ks: list[int] = field(default_factory=list)  # the distinct K (drafts per step) verified, ascending
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    grammar_steps: int = 0  # steps decoded under a grammar (spec/grammar.py)
    grammar_drafts: int = 0  # drafts proposed under a grammar's mask
    grammar_masked_drafts: int = 0  # of those, drafts the mask changed (the drafter's own pick was refused)
    grammar_mask_s: float = 0.0  # host time on grammar masks: filling, applying, committing

    def record_grammar(self, drafts: int, masked: int, mask_s: float) -> None:
        self.grammar_steps += 1
        self.grammar_drafts += drafts
        self.grammar_masked_drafts += masked
        self.grammar_mask_s += mask_s

    def record(self, num_drafts: int, num_accepted: int, num_emitted: int) -> None:
        """One step of one sequence: num_drafts verified, num_accepted of them kept."""
        self.steps += 1
        self.emitted += num_emitted
        if num_drafts == 0:
            return
        self.spec_steps += 1
        self.drafted += num_drafts
        self.accepted += num_accepted
        grow = num_drafts - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)
        for j in range(num_drafts):
            self.drafted_by_position[j] += 1
        for j in range(num_accepted):
            self.accepted_by_position[j] += 1
        if num_accepted < num_drafts:
            self.rollbacks += 1

    def note_k(self, k: int) -> None:
        """A step verified k drafts for this request (the policy's K, or fewer near its limits)."""
        if k > 0 and k not in self.ks:
            self.ks.append(k)
            self.ks.sort()

    def add_times(self, draft_s: float, verify_s: float, commit_s: float) -> None:
        self.draft_s += draft_s
        self.verify_s += verify_s
        self.commit_s += commit_s

    @property
    def mean_accepted(self) -> float:
        """Drafts kept per speculative step (bench.acceptance's mean_accepted)."""
        return self.accepted / self.spec_steps if self.spec_steps else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per speculative step: kept drafts plus the target's own token."""
        return self.mean_accepted + 1.0 if self.spec_steps else 1.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(mean_accepted=self.mean_accepted, mean_accepted_length=self.mean_accepted_length,
                   acceptance_rate=self.acceptance_rate, acceptance_by_position=self.acceptance_by_position)
        return out


@dataclass
class RequestStats(SpecStats):
    arrival_time: float = 0.0  # time.monotonic() seconds
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    speculation: str = "off"  # on | off | fallback: what this request actually used
    trigger_events: list[tuple[str, int]] = field(default_factory=list)  # (event, output index)

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def as_dict(self) -> dict:
        out = super().as_dict()
        out.update(queue_s=self.queue_s, ttft_s=self.ttft_s)
        return out


class StepTimes:
    """An engine's steps by what its gate decided ("on", "off", "fallback:<reason>"): steps, wall
    seconds and tokens emitted. Where an `auto` run's time went: the speculative steps that measured
    a losing bucket, its baseline, the held fallback (bench.decode --policy auto reports them)."""

    def __init__(self) -> None:
        self.by: dict[str, list[float]] = {}

    def add(self, key: str, seconds: float, tokens: int, steps: int = 1) -> None:
        row = self.by.setdefault(key, [0, 0.0, 0])
        row[0] += steps
        row[1] += seconds
        row[2] += tokens

    def merged(self, other: StepTimes) -> StepTimes:
        out = StepTimes()
        for src in (self, other):
            for key, (n, s, t) in src.by.items():
                out.add(key, s, t, n)
        return out

    def as_dict(self) -> dict:
        return {key: {"steps": int(n), "seconds": round(s, 6), "tokens": int(t),
                      "us_per_token": round(1e6 * s / t, 2) if t else None}
                for key, (n, s, t) in sorted(self.by.items())}
