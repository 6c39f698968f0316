"""`linear(x, w, b)`: F.linear, except fp32 on the CPU, where it runs oneDNN with the weight packed once.

Why: at the row counts decoding produces (1 token, or K+1 for a verify), torch's CPU F.linear goes to
MKL, whose small-M sgemm repacks the weight on every call; on the AMD EPYC we run on, a 4-row
[4096 x 256] product took 217 us against 62 us for oneDNN on a pre-packed weight (0.2-0.5x the time
for every weight shape of the default specialists at 2-8 rows, about even at one row).

And exactness: on AVX-512 CPUs without AMX (the AMD EPYC we develop and run CI on), with the
weight in oneDNN's blocked layout (packed for a batch hint >= 2), a row's result does not depend on
how many rows are in the call, nor on the thread count, bit for bit (`tests/test_linear.py` checks
1..300 rows). With MKL it does: a 4-row verify and a 1-row decode of the same token differed in the
last bits. So there a verify computes exactly the products plain decoding would, and a conv state
committed after a verify equals the one a fresh prefill makes. On a Xeon with AMX (the H100 host)
oneDNN picks kernels whose rows differ in the last bits at 1 and 2 rows for some shapes: there the
products are only close, as with MKL (greedy exactness never rested on bit-identical products).

On CUDA a product of 2-8 rows runs as a batched GEMV (one kernel per row, `_few_rows_cuda`), not
cuBLAS's split-K GEMM.

`proposal_linear(w)` is for products that only propose (the drafter's): int8 weights, bf16
activations. In a decode step the weights stream from L3 (a layer's are larger than L2), so bytes
per weight set a large product's time.

The packed copy is made on first use and cached per (weight tensor, dtype) (by identity, dropped with
the tensor, and remade if the tensor is changed in place). CANTATA_CPU_LINEAR=torch turns it off
(plain F.linear everywhere), for A/B measurements.
"""

from __future__ import annotations

import os
import threading
import weakref

import torch
import torch.nn.functional as F

from specialists.ops.attention import HALF

__all__ = ["exact_linear", "linear", "onednn_enabled", "proposal_linear", "quantize_int8", "quantize_blocks", "int8_of"]

_HINT = 4  # the batch hint of the packed layout; any hint >= 2 gives the row-invariant blocked layout
_lock = threading.Lock()
_packed: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}  # id(w) -> (ref to w, w._version, packed)
_quantized: dict[int, tuple[weakref.ref, "_Int8Linear"]] = {}  # id(w) -> (ref to w, its int8 product): quantize_int8


def _available() -> bool:
    if os.environ.get("CANTATA_CPU_LINEAR", "onednn") == "torch":
        return False
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


_ENABLED = _available()
_LINEAR = torch.ops.mkldnn._linear_pointwise.default if _ENABLED else None  # looked up once


def onednn_enabled() -> bool:
    return _ENABLED


def _pack(w: torch.Tensor) -> torch.Tensor:
    key = id(w)
    hit = _packed.get(key)
    if hit is not None and hit[0]() is w and hit[1] == w._version:
        return hit[2]
    with _lock:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), _HINT)
        _packed[key] = (weakref.ref(w, lambda _, key=key: _packed.pop(key, None)), w._version, packed)
    return packed


def _few_rows_cuda(x: torch.Tensor, w: torch.Tensor) -> bool:
    """A CUDA product of 2-8 rows (a verify's K+1 tokens) that cuBLAS would run as a split-K GEMM
    (two kernels, 5.5-14 us on an H100 at d = 256) where one batched GEMV per row takes 2.6-3.6 us
    (measured at N = 256..1160, K = 256..512; at N >= 640 with <= 4 rows the GEMM is as fast)."""
    if not (x.is_cuda and x.dim() == 2 and w.dim() == 2):
        return False
    m, n = x.shape[0], w.shape[0]
    return 2 <= m <= 8 and n <= 2048 and (n < 640 or m > 4)


def exact_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`linear`, except on CUDA in half precision at most decode_fused.MAX_ROWS rows (decode and verify
    steps): the `mma` product, which gives a row the same bits at any row count, so a verify computes
    exactly its decodes' products. cuBLAS picks its kernel by the row count; in bf16 that moved greedy
    tokens (the lm_head and the Mamba layers' products of the toys at batch 8, K=5: 48 rows against 8)."""
    if x.is_cuda and x.dtype in HALF and x.dim() == 2 and w.dim() == 2:
        from specialists.ops import decode_fused  # Triton: a GPU install has it

        if decode_fused.enabled(x):
            return decode_fused.mma(x.contiguous(), w.contiguous(), b)
    return linear(x, w, b)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ w[out, in]^T (+ b) -> [..., out]."""
    if _few_rows_cuda(x, w):
        out = torch.matmul(x[:, None, None, :], w.t()[None]).view(x.shape[0], w.shape[0])  # batched over rows
        return out if b is None else out + b
    if _quantized and x.device.type == "cpu":
        hit = _quantized.get(id(w))
        if hit is not None and hit[0]() is w:  # weight-only int8 (quantize_int8)
            out = hit[1](x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], w.shape[0])
            return out if b is None else out + b
    if not (_ENABLED and x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu"
            and w.dim() == 2 and x.numel() and not torch.is_grad_enabled()):
        return F.linear(x, w, b)
    if x.dim() == 2:
        return _LINEAR(x if x.is_contiguous() else x.contiguous(), _pack(w), b, "none", [], "")
    out = _LINEAR(x.reshape(-1, x.shape[-1]).contiguous(), _pack(w), b, "none", [], "")
    return out.view(*x.shape[:-1], w.shape[0])


class _Int8Linear:
    """Weight-only int8 (symmetric, one scale per output row): a quarter of the fp32 weight bytes. With
    `native` (ops/native.py, a CPU with AVX-512 VNNI) the activations are rounded per row to int16 and
    the sums are exact integers (an [960 x 576] product of one row ~13 us, the 30 layers of
    SmolLM2-135M's products at 44-57 GB/s); otherwise bf16 activations through torch's
    `_weight_int8pack_mm` (an [896 x 256] product whose weight misses L2 took 12 us at one row, against
    38 us for oneDNN fp32 and 105 us for F.linear)."""

    __slots__ = ("w", "scale", "scale32", "native")

    def __init__(self, w: torch.Tensor, native: bool = False) -> None:
        w = w.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.w = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scale32 = scale.contiguous()
        self.scale = scale.to(torch.bfloat16)
        self.native = native  # products through ops/native.py (int16 activations), not torch's kernel

    def __call__(self, x: torch.Tensor, low: bool = False) -> torch.Tensor:  # [T, in] -> [T, out] fp32 (bf16 if low)
        if self.native:
            from specialists.ops import native

            return native.qlinear(x.float(), self.w, self.scale32)
        out = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.w, self.scale)
        return out if low else out.float()


class BlockLinear:
    """A weight as a GGUF's own blocks (specialists/ggml_blocks.py: Q4_1 or Q8_0), packed for the native
    kernel (ops/native.blinear: activations rounded to int8 per block of 32, exact block sums)."""

    __slots__ = ("kind", "packed", "n")

    def __init__(self, kind: int, packed: torch.Tensor, n: int) -> None:
        self.kind, self.packed, self.n = kind, packed, n

    def __call__(self, x: torch.Tensor, low: bool = False) -> torch.Tensor:
        from specialists.ops import native

        return native.blinear(x.float(), self.kind, self.packed, self.n)


def _native_proposals() -> bool:
    if os.environ.get("CANTATA_NATIVE_DRAFTER", "1") == "0":
        return False
    from specialists.ops import native

    return native.available()


def proposal_linear(w: torch.Tensor):
    """A callable (x [T, in], low=False) -> [T, out] for weights whose products only propose (the
    drafter's: verification decides what is kept, so rounding changes no emitted token). On the CPU
    in fp32: int8 weights with bf16 activations (low=True returns the bf16 product, for a caller
    that feeds it straight into the next one); elsewhere the exact `linear`."""
    if (w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2 and _ENABLED
            and hasattr(torch, "_weight_int8pack_mm")):
        return _Int8Linear(w, native=_native_proposals())
    return lambda x, low=False: linear(x, w)


def quantize_int8(w: torch.Tensor, native: bool = False) -> bool:
    """From now on `linear(x, w)` on the CPU reads an int8 copy of w (one scale per output row, fp32
    out): a quarter of fp32's bytes. Activations are bf16 (torch's kernel), or with `native` int16 per
    row (ops/native.py's kernel). A row's product does not depend on the other rows of the call
    (checked by tests/test_quantize.py), so a verify still computes a plain decode's products. False
    where the kernel is missing or w is not a CPU matrix (nothing registered)."""
    if not (w.device.type == "cpu" and w.dim() == 2 and w.is_floating_point() and hasattr(torch, "_weight_int8pack_mm")):
        return False
    _register(w, _Int8Linear(w, native))
    return True


def quantize_blocks(w: torch.Tensor, kind: int, packed: torch.Tensor) -> None:
    """From now on `linear(x, w)` on the CPU reads `packed` (GGML blocks standing for w's values, laid
    out by ggml_blocks.pack) through the native kernel."""
    _register(w, BlockLinear(kind, packed, w.shape[0]))


def _register(w: torch.Tensor, impl: "_Int8Linear | BlockLinear") -> None:
    """linear(x, w) runs impl from now on, for as long as w lives."""
    key = id(w)
    with _lock:
        _quantized[key] = (weakref.ref(w, lambda _, key=key: _quantized.pop(key, None)), impl)


def int8_of(w: torch.Tensor) -> "_Int8Linear | BlockLinear | None":
    """The quantized copy quantize_int8 (or quantize_blocks) registered for w, or None."""
    hit = _quantized.get(id(w))
    return hit[1] if hit is not None and hit[0]() is w else None
