"""mamba-ssm's Triton SSD ops on CUDA, imported without running mamba_ssm/__init__.py.

The `gpu` extra installs mamba-ssm; its PyPI sdist builds a pure-Python wheel of the Triton ops
(MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE pip wheel --no-deps --no-build-isolation), but the
package's __init__ imports a CUDA extension such a wheel lacks. We register a bare package object for
`mamba_ssm` (no __init__ executed) and import only the Triton modules. Never called on CPU-only runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import types
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TritonSSD:
    chunk_scan_combined: Callable  # mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, ...)
    selective_state_update: Callable  # selective_state_update(state, x, dt, A, B, C, D, ...)


def _unfused(*args, **kwargs) -> None:
    """Stand-in for the fused conv+scan, which needs causal-conv1d's CUDA extension: returning None
    makes transformers' Bamba mixer take its unfused path (torch conv1d + the Triton chunk scan)."""
    return None


def load_triton_ssd() -> TritonSSD | None:
    """The Triton ops, or None where there is no CUDA device or mamba-ssm is not installed."""
    if not torch.cuda.is_available():
        return None
    spec = importlib.util.find_spec("mamba_ssm")
    if spec is None or spec.submodule_search_locations is None:
        return None
    # fp32 means fp32: without this Triton's tl.dot rounds fp32 inputs to TF32, which moved the chunk
    # scan's outputs by ~3e-3 from the torch reference on an H100 (bf16 inputs are not affected)
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    if "mamba_ssm" not in sys.modules:
        package = types.ModuleType("mamba_ssm")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["mamba_ssm"] = package
    try:
        ssd = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
        ssu = importlib.import_module("mamba_ssm.ops.triton.selective_state_update")
    except ImportError as exc:  # triton or einops missing: stay on the torch path
        log.warning("mamba-ssm Triton ops unavailable (%s); using the torch reference", exc)
        return None
    if importlib.util.find_spec("causal_conv1d") is None:
        ssd.mamba_split_conv1d_scan_combined = _unfused
    package = sys.modules["mamba_ssm"]
    package.mamba_chunk_scan_combined = ssd.mamba_chunk_scan_combined
    package.selective_state_update = ssu.selective_state_update
    return TritonSSD(ssd.mamba_chunk_scan_combined, ssu.selective_state_update)
