"""torch.profiler over a few decode steps of a running engine (bench side; serving code knows nothing of it).

  summary = profile_decode(engine, prompts, steps=16, path=Path("prof.txt"), device="cuda")

Writes the key_averages table (sorted by device time on a GPU, CPU time elsewhere) under a header of
per-step figures, and returns them: wall ms per step, device kernels per step (every kernel, memcpy
and memset the profiler saw on the device, those replayed inside CUDA graphs included), summed
device time per step, and host ms per step = wall minus the time the host spent blocked in CUDA
synchronization calls (what the host itself costs a step).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _summary(prof: Any, steps: int, wall_s: float) -> dict:
    kernels = device_us = blocked_us = 0.0
    for e in prof.events():
        dur = e.time_range.elapsed_us()
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            device_us += dur
        elif e.name in SYNC_CALLS:
            blocked_us += dur
    return {"steps": steps, "wall_ms_per_step": round(1e3 * wall_s / steps, 4),
            "kernels_per_step": round(kernels / steps, 2), "device_ms_per_step": round(device_us / 1e3 / steps, 4),
            "host_ms_per_step": round((1e6 * wall_s - blocked_us) / 1e3 / steps, 4)}


def _table(prof: Any, cuda: bool) -> str:
    keys = ("self_device_time_total", "self_cuda_time_total") if cuda else ("self_cpu_time_total",)
    for key in keys:
        try:
            return prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=80)
        except (AttributeError, KeyError, ValueError):
            continue
    return prof.key_averages().table(row_limit=60)


def profile_decode(engine: Any, prompts: list[list[int]], steps: int, path: Path, device: str,
                   label: str = "plain engine") -> dict:
    """Prefills `prompts` in one engine step, profiles the next `steps` steps (decode only), finishes
    the requests; writes the table to `path` and returns the per-step summary."""
    from specialists.sampling import SamplingParams

    per_step = getattr(getattr(engine, "runner", None), "decode_steps", 1)  # multi-step decodes: tokens per step
    params = SamplingParams(max_tokens=steps * per_step + 4, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while engine.scheduler.waiting:  # the prefills
        engine.step()
    _sync(device)
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(device)
        wall = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    summary = {**_summary(prof, steps, wall), "decode_steps": per_step}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {json.dumps(summary)}\n# {len(prompts)} sequences decoding, {label}\n\n" + _table(prof, cuda) + "\n")
    return summary
