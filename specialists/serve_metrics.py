"""A specialist's metrics through ray.serve.metrics inside a Serve replica (exported with Ray's
metrics): `ServeMetrics` implements `specialists.metrics.SpecialistMetrics`. This module does not
import Ray: `specialists.deployment.replica_metrics` (one of the two modules that may) passes the
`ray.serve.metrics` module in."""

from __future__ import annotations

from typing import Any

from specialists.metrics import SPECULATION_STATUSES

_LATENCY_BOUNDARIES = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class ServeMetrics:
    """Per-specialist metrics through ray.serve.metrics (exported with Ray's metrics); `metrics` is that
    module (its Histogram, Counter and Gauge classes)."""

    def __init__(self, specialist: str, metrics: Any) -> None:
        self.tags = {"specialist": specialist}
        keys = ("specialist",)
        self.ttft = metrics.Histogram("cantata_ttft_s", "Time to first token (s).", _LATENCY_BOUNDARIES, keys)
        self.itl = metrics.Histogram("cantata_inter_token_latency_s", "Time between tokens (s).",
                                     _LATENCY_BOUNDARIES, keys)
        self.tokens = metrics.Counter("cantata_generated_tokens", "Tokens generated.", keys)
        self.requests = metrics.Counter("cantata_requests", "Finished generations.", ("specialist", "speculation"))
        self.tokens_per_s = metrics.Gauge("cantata_tokens_per_s", "Decode tokens/s of the last request.", keys)
        self.acceptance = metrics.Gauge("cantata_acceptance_rate", "Accepted/drafted of the last request.", keys)
        self.mean_accepted = metrics.Gauge("cantata_mean_accepted_length",
                                           "Tokens per speculative step of the last request.", keys)
        self.drafted = metrics.Counter("cantata_drafted_tokens", "Draft tokens verified.", keys)
        self.accepted = metrics.Counter("cantata_accepted_tokens", "Draft tokens accepted.", keys)
        self.status = metrics.Gauge("cantata_speculation_status",
                                    "1 for the specialist's current speculation status, 0 for the others.",
                                    ("specialist", "status"))

    def observe(self, ttft_s: float | None, inter_token_s: list[float], completion_tokens: int, decode_s: float,
                stats: dict[str, Any], speculation: str) -> None:
        if ttft_s is not None:
            self.ttft.observe(ttft_s, self.tags)
        for gap in inter_token_s:
            self.itl.observe(gap, self.tags)
        if completion_tokens:
            self.tokens.inc(completion_tokens, self.tags)
        if decode_s > 0 and completion_tokens > 1:
            self.tokens_per_s.set((completion_tokens - 1) / decode_s, self.tags)
        self.requests.inc(1, {**self.tags, "speculation": speculation})
        drafted, accepted = int(stats.get("drafted") or 0), int(stats.get("accepted") or 0)
        if drafted:
            self.drafted.inc(drafted, self.tags)
            self.acceptance.set(accepted / drafted, self.tags)
            self.mean_accepted.set(float(stats.get("mean_accepted_length") or 1.0), self.tags)
        if accepted:
            self.accepted.inc(accepted, self.tags)

    def set_status(self, status: str) -> None:
        for s in SPECULATION_STATUSES:
            self.status.set(1.0 if s == status else 0.0, {**self.tags, "status": s})

