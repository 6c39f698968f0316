"""Bench-side timers: the device's read bandwidth, and per-step times of a running engine.

  measure_bandwidth("cuda")                 # {"copy_tb_s", "read_tb_s"}: a D2D copy and a read-reduce
  with StepProbe(engine, "cuda") as probe:  # wraps the engine's step, its runner's forward and the
      engine.generate(...)                  # drafter's chains (instance attributes, restored on exit)
  probe.records                             # one StepRecord per engine step

The probe synchronizes the device around every wrapped call, so it perturbs what it measures by one
sync each: it runs in its own pass, after the timed run. Serving code knows nothing of it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

CHAIN_METHODS = ("chain", "chain_static", "chain_ahead")


def _sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _median_seconds(fn: Callable[[], Any], device: str, reps: int) -> float:
    """Median seconds of fn over reps calls (CUDA events on a GPU, wall clock elsewhere), after 2 warm calls."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(2):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_bandwidth(device: str, mib: int | None = None, reps: int = 10) -> dict:
    """The device memory's measured bandwidth in TB/s (1e12 B/s): `copy_tb_s` counts the bytes read and
    written by a device-to-device copy of a `mib` MiB buffer, `read_tb_s` the bytes read by a sum over
    it; medians of `reps`. Default buffer: 2 GiB on a GPU, 256 MiB elsewhere."""
    mib = mib or (2048 if torch.device(device).type == "cuda" else 256)
    n = mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    t_copy = _median_seconds(lambda: dst.copy_(src), device, reps)
    t_read = _median_seconds(lambda: src.sum(), device, reps)
    del src, dst
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return {"copy_tb_s": 2 * nbytes / t_copy / 1e12, "read_tb_s": nbytes / t_read / 1e12, "buffer_mib": mib}


@dataclass
class StepRecord:
    """One engine step: its wall seconds (device synchronized before and after), its target forward's
    (the runner's run: verify or decode, with the drafter's rebuild where the step runs one), and its
    drafter chains'."""

    seconds: float
    prefill: bool = False
    q: int = 0  # tokens per decode row in the forward, 1 + drafts (0: no decode rows; -1: rows differ)
    rows: int = 0
    forward_s: float = 0.0
    chain_s: float = 0.0
    chains: int = 0


@dataclass
class StepProbe:
    engine: Any
    device: str
    records: list[StepRecord] = field(default_factory=list)
    chain_calls: dict[str, int] = field(default_factory=dict)  # method name -> calls (which chain path ran)
    _current: StepRecord | None = None
    _depth: int = 0
    _wrapped: list[tuple[Any, str]] = field(default_factory=list)

    def __enter__(self) -> "StepProbe":
        self._wrap(self.engine, "step", self._on_step)
        self._wrap(self.engine.runner, "run", self._on_forward)
        if self.engine.drafter is not None:
            for name in CHAIN_METHODS:
                self._wrap(self.engine.drafter, name, self._chain_hook(name))
        return self

    def __exit__(self, *exc: Any) -> None:
        for obj, name in self._wrapped:
            delattr(obj, name)  # the class's method shows through again
        self._wrapped.clear()

    def _wrap(self, obj: Any, name: str, hook: Callable) -> None:
        original = getattr(obj, name)

        def wrapper(*args: Any, **kw: Any) -> Any:
            return hook(original, args, kw)

        setattr(obj, name, wrapper)
        self._wrapped.append((obj, name))

    def _timed(self, fn: Callable, args: tuple, kw: dict) -> tuple[Any, float]:
        _sync(self.device)
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        _sync(self.device)
        return out, time.perf_counter() - t0

    def _on_step(self, fn: Callable, args: tuple, kw: dict) -> Any:
        self._current = StepRecord(0.0)
        out, dt = self._timed(fn, args, kw)
        self._current.seconds = dt
        self.records.append(self._current)
        self._current = None
        return out

    def _on_forward(self, fn: Callable, args: tuple, kw: dict) -> Any:
        rows = args[0] if args else kw["rows"]
        out, dt = self._timed(fn, args, kw)
        rec = self._current
        if rec is not None:
            rec.prefill = rec.prefill or any(r.prefill for r in rows)
            qs = {1 + r.k for r in rows if not r.prefill}
            rec.q = qs.pop() if len(qs) == 1 else (0 if not qs else -1)
            rec.rows, rec.forward_s = len(rows), rec.forward_s + dt
        return out

    def _chain_hook(self, name: str) -> Callable:
        def hook(fn: Callable, args: tuple, kw: dict) -> Any:
            if not self._depth:
                self.chain_calls[name] = self.chain_calls.get(name, 0) + 1
            return self._on_chain(fn, args, kw)

        return hook

    def _on_chain(self, fn: Callable, args: tuple, kw: dict) -> Any:
        if self._depth:  # a chain method calling another: time the outer one only
            return fn(*args, **kw)
        self._depth += 1
        try:
            out, dt = self._timed(fn, args, kw)
        finally:
            self._depth -= 1
        if self._current is not None:
            self._current.chain_s += dt
            self._current.chains += 1
        return out


def decode_records(records: list[StepRecord], q: int) -> list[StepRecord]:
    """Steps with no prefill whose every decode row ran q tokens (1: plain decode; K+1: verify)."""
    return [r for r in records if not r.prefill and r.q == q]


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
