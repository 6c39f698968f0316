"""CUDA graphs of step functions, captured once per shape key and replayed after.

  graphs = GraphCache(enabled=device.type == "cuda")
  out = graphs.run(("verify", B, q, W), fn)   # fn() reads only static tensors, returns tensors

On the first call for a key, `fn` runs once eagerly (lazy initialisations: cuBLAS handles, cached
masks, tables) and is then captured into a CUDA graph with its own memory pool, which is replayed
for this and every later call of that key. What `fn` returned at capture is what every replay
refills: the caller reads those tensors after `run` and must be done with them before the next
replay of the same key.

The contract for `fn`: every input it reads sits in a tensor whose storage outlives the graph (the
runner's static buffers, caches), it makes no host sync and no host-to-device copy of a Python
value, its shapes depend on the key alone, and running it twice in a row has the effect of running
it once (it may write caches only with values that depend on its inputs alone, like K/V at fixed
slots; state updates that advance per call are returned and committed by the caller). The eager
warm-up and the replay that follows capture both run it, so the second condition is what makes the
first call of a key correct.

When not enabled (CPU, or graphs off in the engine's options: specialists/options.py) `run` just calls `fn`.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Hashable, NamedTuple

import torch

__all__ = ["GraphCache", "capture_stream", "no_collection"]


@contextmanager
def no_collection() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (as it was after). A collection that runs during a
    capture, triggered by the capture's own allocations, may destroy an unreachable engine's graphs or
    pinned buffers (cudaGraphExecDestroy, cudaFreeHost), which a capture forbids: the capture is
    invalidated ("operation failed due to a previous error during capture", once on the H100 in the
    CUDA tests after other files' engines, session 21; CUDAGraph::reset warned "operation not
    permitted when stream is capturing"). Deferred, such a collection runs after the capture."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


_CAPTURE_STREAMS: dict[int, Any] = {}


def capture_stream() -> Any:
    """The side stream every capture on the current device runs on (a capture cannot run on the
    default stream). cuBLAS keeps a workspace per stream it runs on (32 MB on an H100), allocated in the
    memory pool of the first graph captured on that stream: with a new stream per capture (torch hands
    them out from a pool of 32) the graphs kept up to 32 workspaces, ~1 GB of llama-1b's 2.2 GB of graph
    pools after warm-up (H100, session 23, .probe/poolprobe.py)."""
    dev = torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(dev)
    if stream is None:
        stream = _CAPTURE_STREAMS[dev] = torch.cuda.Stream()
    return stream


class _Captured(NamedTuple):
    graph: Any  # torch.cuda.CUDAGraph
    outputs: Any  # what fn returned at capture: refilled by every replay


class GraphCache:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._graphs: dict[Hashable, _Captured] = {}
        self.captures = 0  # graphs captured so far (for tests and metrics)
        self.replays = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph (the static buffers they read were reallocated)."""
        self._graphs.clear()

    def has(self, key: Hashable) -> bool:
        return key in self._graphs

    def keys(self) -> list[Hashable]:
        """The keys of every graph captured (in capture order)."""
        return list(self._graphs)

    def outputs(self, key: Hashable) -> Any:
        """The static outputs of the graph captured under key (None if there is none)."""
        entry = self._graphs.get(key)
        return None if entry is None else entry.outputs

    def _capture(self, fn: Callable[[], Any], pool: Any = None) -> _Captured:
        fn()  # eager warm-up: lazy initialisations happen outside the capture
        # capture on a side stream (a capture cannot run on the default stream); unlike torch.cuda.graph
        # this does not collect garbage and empty the allocator's cache per graph (tens of ms each), but
        # no collection may run during the capture either (no_collection)
        stream = capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), no_collection():
            graph.capture_begin(pool=pool)
            try:
                out = fn()
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        self.captures += 1
        return _Captured(graph, out)

    def run(self, key: Hashable, fn: Callable[[], Any], pool: Any = None) -> Any:
        """pool: a memory pool (torch.cuda.graph_pool_handle()) the capture shares with the other graphs
        given it, for graphs that never run at once and whose outputs are read before the next of them
        replays (a graph's outputs may then sit where another's temporaries go: prefill_graph.py)."""
        if not self.enabled:
            return fn()
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(fn, pool)
        entry.graph.replay()
        self.replays += 1
        return entry.outputs
