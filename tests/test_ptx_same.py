"""bench.ptx_same: the product kernel compiled for sm_90 on a machine without a GPU (Triton's bundled
ptxas), its PTX compared without debug information."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from bench import ptx_same  # noqa: E402


def test_the_kernel_compiles_for_sm90_and_kinds_show_in_its_ptx() -> None:
    kernel = ptx_same.tree_kernel()
    plain = {**ptx_same.BASE, "PRO": 0, "SPLIT": 1, "KS": 2048, "GLU": False}
    a = ptx_same.kernel_ptx(kernel, plain)
    assert "mma" in a or "wgmma" in a  # the tensor cores' instructions
    assert ".loc" not in a and "$L__tmp" not in a  # locations dropped: an edit's line numbers do not count
    assert ptx_same.kernel_ptx(kernel, plain) == a
    assert ptx_same.kernel_ptx(kernel, {**plain, "PRO": 3}) != a  # the folded norm's sum of squares


def test_two_revisions_are_compared_case_by_case() -> None:
    """The kernel before the folded norm (0d90bf0) against the one after (76e612d): the plain kind kept
    its instructions, the folded kind differs, the SwiGLU end (which 0d90bf0 lacks) is skipped."""
    results = dict(ptx_same.compare("0d90bf0", [(0, 1, False), (3, 1, False), (3, 1, True)], new_rev="76e612d"))
    assert results == {(0, 1, False): True, (3, 1, False): False}
