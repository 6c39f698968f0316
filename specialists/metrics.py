"""What a specialist reports per generation: the `SpecialistMetrics` interface and its no-op
implementation for tests and scripts. The Ray Serve implementation (`ServeMetrics`) lives in
`specialists.serve_metrics`, built only by `specialists.deployment` (which passes Ray's metric classes in)."""

from __future__ import annotations

from typing import Any, Protocol

SPECULATION_STATUSES = ("on", "off", "fallback")  # the values `set_status` takes


class SpecialistMetrics(Protocol):
    def observe(self, ttft_s: float | None, inter_token_s: list[float], completion_tokens: int, decode_s: float,
                stats: dict[str, Any], speculation: str) -> None: ...

    def set_status(self, status: str) -> None: ...


class NullMetrics:
    def observe(self, ttft_s: float | None, inter_token_s: list[float], completion_tokens: int, decode_s: float,
                stats: dict[str, Any], speculation: str) -> None:
        return None

    def set_status(self, status: str) -> None:
        return None
