"""specialists/ops/linear.py: oneDNN products on packed weights (exact path) and the drafter's
int8 proposal products."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specialists.ops import linear as L
from specialists.ops.linear import linear, proposal_linear

# (out, in) of every product in the default specialists: qkv, o, gate_up, down (llama and bamba),
# mamba in_proj / out_proj, the drafter's input projection, the tied lm_head
SHAPES = [(512, 256), (256, 256), (896, 256), (256, 448), (768, 256), (256, 384), (1160, 256), (256, 512), (4096, 256)]

needs_onednn = pytest.mark.skipif(not L.onednn_enabled(), reason="oneDNN is not in this torch build")


def _cpu_has_amx() -> bool:
    try:
        return " amx_tile" in open("/proc/cpuinfo").read()
    except OSError:
        return False


# On AVX-512 CPUs without AMX (the AMD EPYC of CI and development) oneDNN's packed-weight kernel is
# row-invariant. On a Xeon with AMX (the H100 host, torch 2.11) rows at 2 and at 1 differed in the
# last bits for 3 of these shapes: there the products are only close, as with MKL.
ROW_INVARIANT = not _cpu_has_amx()


@needs_onednn
@pytest.mark.parametrize("shape", SHAPES)
def test_rows_do_not_depend_on_the_batch(shape):
    """A row's product is bit-identical whether it runs alone, in a 4-row verify or in a 300-row
    prefill, at any thread count (on CPUs without AMX; close elsewhere)."""
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=g) * 0.05
    x = torch.randn(300, shape[1], generator=g)
    with torch.inference_mode():
        alone = torch.cat([linear(x[i : i + 1], w) for i in range(x.shape[0])])
        if not ROW_INVARIANT:
            for m in (2, 4, 300):
                torch.testing.assert_close(linear(x[:m], w), alone[:m], rtol=1e-5, atol=1e-5)
            return
        for m in (2, 3, 4, 5, 8, 33, 300):
            assert torch.equal(linear(x[:m], w), alone[:m]), m
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(linear(x[:4], w), alone[:4])
        finally:
            torch.set_num_threads(threads)
        torch.testing.assert_close(alone, F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_torch_linear_is_not_row_invariant_which_is_why_this_exists():
    """The reason for the module: MKL's F.linear gives a row different last bits at 1 and 8 rows
    (on this CPU). If torch ever makes it invariant, the oneDNN path can go."""
    g = torch.Generator().manual_seed(0)
    found = False
    for shape in SHAPES:
        w = torch.randn(shape, generator=g) * 0.05
        x = torch.randn(8, shape[1], generator=g)
        one = torch.cat([F.linear(x[i : i + 1], w) for i in range(8)])
        found |= not torch.equal(one, F.linear(x, w))
    assert found


@needs_onednn
def test_bias_shapes_and_fallbacks():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(2, 5, 64, generator=g)
    with torch.inference_mode():
        out = linear(x, w, b)
        assert out.shape == (2, 5, 96)
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        xt = torch.randn(64, 7, generator=g).t()  # not contiguous
        torch.testing.assert_close(linear(xt, w), F.linear(xt, w), rtol=1e-5, atol=1e-5)
        assert linear(x[:, :0], w).shape == (2, 0, 96)  # no rows: F.linear
        assert linear(x.double(), w.double()).dtype == torch.float64  # other dtypes: F.linear
    # with autograd on, F.linear (the packed copy has no gradient)
    wg = w.clone().requires_grad_()
    linear(x, wg).sum().backward()
    assert wg.grad is not None and wg.grad.shape == w.shape


@needs_onednn
def test_packed_copy_follows_in_place_changes():
    w = torch.randn(32, 16)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        first = linear(x, w)
    with torch.no_grad():
        w.mul_(2.0)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, w), 2 * first, rtol=1e-5, atol=1e-5)


def test_proposal_products_are_close_to_the_exact_ones():
    """int8 weights (one scale per row) with bf16 activations on the CPU: within ~1% of fp32,
    which moves drafts only where the drafter was nearly tied."""
    g = torch.Generator().manual_seed(2)
    for shape in SHAPES:
        w = torch.randn(shape, generator=g) * 0.05
        x = torch.randn(4, shape[1], generator=g)
        mm = proposal_linear(w)
        with torch.inference_mode():
            out = mm(x)
        exact = F.linear(x, w)
        assert out.shape == exact.shape and out.dtype == torch.float32
        rel = (out - exact).norm() / exact.norm()
        assert rel < 0.02, (shape, float(rel))
        if L.onednn_enabled():
            assert isinstance(mm, L._Int8Linear) and mm.w.dtype == torch.int8  # the quarter-size copy is what runs
