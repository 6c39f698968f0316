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


def test_scratch_is_one_buffer_per_device_that_grows_and_keeps_what_graphs_captured() -> None:
    """decode_fused.scratch: kernels' partials are views of one fp32 buffer per device; a larger ask
    grows it (doubling), and the buffers handed out before stay allocated (a captured graph keeps
    their addresses)."""
    from specialists.ops import decode_fused

    dev = torch.device("cpu")
    decode_fused._SCRATCH.pop(dev, None)
    a = decode_fused.scratch(dev, 1000)
    b = decode_fused.scratch(dev, 500)
    assert a.dtype == torch.float32 and b.data_ptr() == a.data_ptr() and b.numel() == 500
    first = decode_fused._SCRATCH[dev][0]
    big = decode_fused.scratch(dev, first.numel() + 1)
    assert big.data_ptr() != a.data_ptr() and decode_fused._SCRATCH[dev][-1].numel() == 2 * first.numel()
    assert decode_fused._SCRATCH[dev][0] is first  # still held
    decode_fused._SCRATCH.pop(dev)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs: CANTATA_TEST_DEVICE=cuda")
def test_graphs_keep_no_kernel_partials_in_their_pools(tmp_path) -> None:
    """A graph's private memory pool keeps its own intermediates only: the attention's chunk partials
    and split-K products' partials live in decode_fused.scratch, and every capture runs on one stream
    (graphs.capture_stream), so cuBLAS's per-stream workspace (32 MB) is made once, not per stream of
    torch's pool. llama-1b's shapes (2 layers, widths up to 2048, 8 rows, K=3, the drafter's graphs
    included) reserve < 18 MB a graph (24.4 MB with the scratch alone, H100, session 23)."""
    from bench.shapes import build_checkpoint
    from policies.policy import SpeculationPolicy
    from specialists.engine import Engine

    path = build_checkpoint("llama-1b", tmp_path / "m", torch.bfloat16, "cuda", drafter_k=3,
                            overrides={"num_hidden_layers": 2, "max_position_embeddings": 2048})
    eng = Engine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_num_seqs=8,
                                 policy=SpeculationPolicy(mode="on", num_speculative_tokens=3))
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    n = eng.capture_graphs()
    torch.cuda.synchronize()
    per = (torch.cuda.memory_reserved() - before) / max(n, 1)
    assert n >= 50 and per < 18 * 2**20, (n, per / 2**20)
