"""Is a grammar's host work cheaper queued on the stream (cuLaunchHostFunc) than read with a sync?

  python -m bench.hostfunc_probe [--iters 200] [--results FILE]      (a CUDA device)

A grammar-constrained drafter chain needs each depth's drafts on the host before the next depth's mask
exists. Two ways to get them there: a device sync per depth (what specialists/drafter_guided.py does),
or a host function queued on the stream with the driver's cuLaunchHostFunc, which runs in stream order
on a driver thread while the Python thread goes on queueing (TensorRT-LLM's way), so the step keeps one
sync. This probe measures the second against the first on a loop shaped like a chain's depth (a
512x512 product, the value to the host, a Python function of it, the result back to the device): per
iteration, the device's time with a host function against a sync with .item(). The callback must take
the GIL, so it runs Python only as fast as the GIL changes hands.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from bench.common import device_name, git_commit, record

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_driver: ctypes.CDLL | None = None
_driver_tried = False


def _load_driver() -> ctypes.CDLL | None:
    global _driver, _driver_tried
    if not _driver_tried:
        _driver_tried = True
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, _HOST_FN, ctypes.c_void_p]
            lib.cuLaunchHostFunc.restype = ctypes.c_int
            _driver = lib
        except (OSError, AttributeError):
            _driver = None
    return _driver


class HostQueue:
    """Python callables run in stream order on the current CUDA stream (see the module's docstring)."""

    def __init__(self) -> None:
        self._lib = _load_driver()
        self._pending: dict[int, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self._keys = itertools.count(1)  # 0 would arrive as a NULL pointer
        self._callback = _HOST_FN(self._run)  # kept alive as long as the queue: the driver calls it
        self.error: BaseException | None = None
        self.launched = 0

    @staticmethod
    def available() -> bool:
        return torch.cuda.is_available() and _load_driver() is not None

    def _run(self, key: int | None) -> None:
        with self._lock:
            fn = self._pending.pop(int(key or 0), None)
        if fn is None:
            return
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - kept for check(): nothing may leave a driver callback
            if self.error is None:
                self.error = e

    def launch(self, fn: Callable[[], None]) -> None:
        """Queues fn on the current CUDA stream."""
        if self._lib is None:
            raise RuntimeError("cuLaunchHostFunc is not available (libcuda.so.1 could not be loaded)")
        key = next(self._keys)
        with self._lock:
            self._pending[key] = fn
        stream = torch.cuda.current_stream().cuda_stream
        rc = self._lib.cuLaunchHostFunc(ctypes.c_void_p(stream), self._callback, ctypes.c_void_p(key))
        if rc != 0:
            with self._lock:
                self._pending.pop(key, None)
            raise RuntimeError(f"cuLaunchHostFunc failed with CUresult {rc}")
        self.launched += 1

    def check(self) -> None:
        """Raises the first exception a host function raised since the last check (after a sync)."""
        if self.error is not None:
            e, self.error = self.error, None
            raise RuntimeError("a host function queued on the stream failed") from e


def _loop(queue: HostQueue, iters: int, hostfn: bool) -> float:
    """Seconds per iteration of the depth-shaped loop; checks the result."""
    dev = "cuda"
    x = torch.zeros(1, dtype=torch.int64, device=dev)
    pin_in = torch.zeros(iters, dtype=torch.int64, pin_memory=True)
    pin_out = torch.zeros(iters, dtype=torch.int64, pin_memory=True)
    w = torch.randn(512, 512, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(iters):
        w @ w
        x.add_(1)
        if hostfn:
            pin_in[i:i + 1].copy_(x, non_blocking=True)
            queue.launch(lambda i=i: pin_out.__setitem__(i, pin_in[i] * 10))
            x.copy_(pin_out[i:i + 1], non_blocking=True)
            x.floor_divide_(10)
        else:
            x.fill_(x.item())
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    dt = (time.perf_counter() - t0) / iters
    queue.check()
    if x.item() != iters:
        raise AssertionError(f"wrong result {x.item()} != {iters}")
    return dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hostfunc_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--results", type=Path)
    args = ap.parse_args(argv)
    if not HostQueue.available():
        print("needs a CUDA device and libcuda.so.1", file=sys.stderr)
        return 2
    queue = HostQueue()
    for hostfn in (False, True):  # warm both (Python's first ctypes callback, cuBLAS)
        _loop(queue, 20, hostfn)
    sync_s = min(_loop(queue, args.iters, False) for _ in range(3))
    host_s = min(_loop(queue, args.iters, True) for _ in range(3))
    row = {"bench": "hostfunc_probe", "device": device_name("cuda"), "commit": git_commit(), "iters": args.iters,
           "sync_us_per_iter": round(1e6 * sync_s, 1), "hostfunc_us_per_iter": round(1e6 * host_s, 1),
           "hostfunc_over_sync": round(host_s / sync_s, 3)}
    record(args.results, row)
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
