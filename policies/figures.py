"""The auto gate's rolling figures (policies/gate.py): acceptance over a window of drafted tokens,
and wall seconds per emitted token over a window of steps."""

from __future__ import annotations

from collections import deque


class GateInputError(ValueError):
    """observe() got counts that cannot be: negative, or more accepted than drafted."""


class RollingAcceptance:
    """Accepted/drafted over the last ``window`` drafted tokens.

    Kept per step as (drafted, accepted); when the window overflows, the oldest step is cut down to
    the tokens that still fit, keeping that step's acceptance rate (its tokens are not ordered)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._steps: deque[tuple[float, float]] = deque()  # (drafted, accepted), oldest first
        self._drafted = 0.0
        self._accepted = 0.0

    def add(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self._steps.append((float(drafted), float(accepted)))
        self._drafted += drafted
        self._accepted += accepted
        while self._drafted > self.window:
            old_drafted, old_accepted = self._steps.popleft()
            excess = self._drafted - self.window
            if excess >= old_drafted:  # the whole step leaves the window
                self._drafted -= old_drafted
                self._accepted -= old_accepted
                continue
            kept = old_drafted - excess
            kept_accepted = old_accepted * kept / old_drafted
            self._steps.appendleft((kept, kept_accepted))
            self._drafted = float(self.window)
            self._accepted -= old_accepted - kept_accepted
        if not self._steps:  # float drift cannot outlive an empty window
            self._drafted = self._accepted = 0.0

    @property
    def drafted(self) -> float:
        return self._drafted

    @property
    def full(self) -> bool:
        return self._drafted >= self.window

    @property
    def rate(self) -> float | None:
        if self._drafted <= 0:
            return None
        return min(1.0, max(0.0, self._accepted / self._drafted))


class SecondsPerToken:
    """Wall seconds per emitted token over the last ``steps`` steps (None before any)."""

    def __init__(self, steps: int = 32) -> None:
        self._steps: deque[tuple[float, int]] = deque(maxlen=steps)

    def add(self, seconds: float, tokens: int) -> None:
        if tokens > 0:
            self._steps.append((seconds, tokens))

    @property
    def count(self) -> int:
        return len(self._steps)

    @property
    def value(self) -> float | None:
        tokens = sum(t for _, t in self._steps)
        return sum(s for s, _ in self._steps) / tokens if tokens else None

    @property
    def median(self) -> float | None:
        """The median step's seconds per token: a plain figure that a few slow steps (a step right
        after a switch, a cache refill) do not move."""
        per = sorted(s / t for s, t in self._steps)
        return per[len(per) // 2] if per else None
