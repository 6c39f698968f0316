"""Learning-rate schedule: linear warm-up, cosine decay to a floor (never to zero: lesson 3).

Progress is the larger of steps done / total steps and seconds spent / time budget, so a run given a
wall-clock budget (a 10-minute GPU lease) still completes its decay and ends at the floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CosineWithFloor:
    peak_lr: float
    total_steps: int
    warmup_steps: int = 100
    floor_ratio: float = 0.1  # the learning rate never goes below peak_lr * floor_ratio
    time_budget_s: float | None = None

    def progress(self, step: int, elapsed_s: float = 0.0) -> float:
        p = step / max(1, self.total_steps)
        if self.time_budget_s:
            p = max(p, elapsed_s / self.time_budget_s)
        return min(1.0, p)

    def lr(self, step: int, elapsed_s: float = 0.0) -> float:
        floor = self.peak_lr * self.floor_ratio
        if step < self.warmup_steps:
            return floor + (self.peak_lr - floor) * (step + 1) / self.warmup_steps
        p = self.progress(step, elapsed_s)
        return floor + (self.peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * p))

    def done(self, step: int, elapsed_s: float) -> bool:
        return self.progress(step, elapsed_s) >= 1.0
