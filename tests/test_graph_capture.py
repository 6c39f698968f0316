"""specialists/graphs.py: no garbage collection runs while a CUDA graph is captured (a collection that
destroys another graph or a pinned buffer inside a capture invalidates it)."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from specialists.graphs import GraphCache, no_collection

DEVICE = os.environ.get("CANTATA_TEST_DEVICE", "cpu")


def test_no_collection_turns_the_collector_off_and_restores_it() -> None:
    assert gc.isenabled()
    with no_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), no_collection():  # restored after an error too
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()  # a caller that had it off keeps it off
    try:
        with no_collection():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs: CANTATA_TEST_DEVICE=cuda")
def test_a_capture_survives_collectable_graphs_and_many_allocations() -> None:
    """Garbage holding a captured graph, reachable only through a cycle, then a capture that allocates
    enough Python objects to trigger the collector: the graph must not be destroyed inside the capture."""
    old = GraphCache(True)
    x = torch.zeros(4, device="cuda")
    old.run("k", lambda: x + 1)
    cycle = [old]
    cycle.append(cycle)
    del old, cycle
    seen = []

    def fn() -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            seen.append(gc.isenabled())
            junk = [[i] for i in range(5000)]  # past the collector's threshold
            for a, b in zip(junk, junk[1:]):
                a.append(b)
        return x * 2

    graphs = GraphCache(True)
    out = graphs.run("k", fn)
    torch.cuda.synchronize()
    assert seen == [False] and out.tolist() == [0.0] * 4
    x.fill_(3.0)
    assert graphs.run("k", fn).tolist() == [6.0] * 4
