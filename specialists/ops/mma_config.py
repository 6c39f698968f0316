"""Tile configurations of decode_fused.mma: (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) by the
product's kind and its weight's shape, never by the row count (a row's result is the same at every M).

Kinds (`prologue`): 0 a plain product (the residual add after it is free), 1 under the RMSNorm (x * gain
in the loop), 2 SiLU * up before it (x = [gate | up]), 3 under the RMSNorm with the gain folded into the
weight (x streams as it is), 4 kind 3 with the SwiGLU at the end (w = [gate | up], N = the ffn size).
"""

from __future__ import annotations

import triton

__all__ = ["mma_config", "MEASURED"]

# the least time at one row in sweeps over L2-cold weights: kinds 0-2 on an H100 (`bench.fused_products
# --sweep`, the `mma_probe` rows in bench/results/fused_products.jsonl), kinds 3 and 4 and the plain down
# after a SwiGLU end on an H200 (2026-11-28, session 32: `.probe/fold_probe.py`, bench/results/fold_probe.jsonl)
MEASURED = {
    (1, 3072, 2048): (64, 256, 4, 3, 2), (1, 16384, 2048): (64, 256, 4, 2, 1),  # llama-1b qkv, gate/up
    (0, 2048, 2048): (64, 128, 4, 4, 4), (2, 2048, 8192): (64, 128, 8, 3, 8),  # llama-1b o, down
    (1, 5120, 3072): (64, 256, 4, 3, 1), (1, 16384, 3072): (64, 256, 4, 3, 1),  # llama-3b
    (0, 3072, 3072): (64, 128, 4, 3, 4), (2, 3072, 8192): (64, 128, 4, 3, 8),
    (1, 960, 576): (64, 256, 4, 6, 1), (1, 3072, 576): (64, 256, 4, 4, 1),  # smollm2-135m
    (0, 576, 576): (16, 128, 4, 6, 1), (2, 576, 1536): (64, 128, 4, 4, 8),
    (0, 4096, 2048): (64, 256, 4, 3, 1),  # llama-1b's and bamba-1b's lm_head (vocab 4096): 9.18 us, 9.63 split 4 (s18)
    # H200: llama-1b qkv 8.42 us unsplit (RoPE fuses; 9.03 as kind 1), gate/up + SwiGLU 18.91, down 12.63
    (3, 3072, 2048): (64, 256, 4, 3, 1), (4, 8192, 2048): (64, 128, 4, 4, 1), (0, 2048, 8192): (64, 128, 4, 3, 8),
    # H200: llama-3b qkv 12.19 (14.25 as kind 1), gate/up + SwiGLU 26.83 (30.21 without it), down 17.50
    (3, 5120, 3072): (64, 256, 4, 3, 1), (4, 8192, 3072): (64, 128, 4, 4, 1), (0, 3072, 8192): (64, 128, 4, 3, 4),
}


def mma_config(prologue: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """Measured for the named shapes (kind 3 falls back to kind 1's entry, a plain product to the same
    weight's entry under the SiLU prologue), else 64 outputs a program; a product without the RMSNorm
    splits K until ~256 programs (a program streams ~20 GB/s: a 2048-row weight in 32 programs reads at
    0.65 TB/s) keeping >= 256 columns a split, one under the RMSNorm (wide products; a split cost
    llama-3b's q/k/v 40%); a SwiGLU end takes 32 outputs a program below 128 programs of 64."""
    for key in ((prologue, n, k), (1 if prologue == 3 else 2 if prologue == 0 else prologue, n, k)):
        if key in MEASURED:
            return MEASURED[key]
    if prologue in (1, 3):
        return 64, 256, 4, 3, 1
    if prologue == 4:
        return (64 if n // 64 >= 128 else 32), 128, 4, 4, 1
    split = 1
    while split < 8 and triton.cdiv(n, 64) * split * 2 <= 256 and k // (split * 2) >= 256:
        split *= 2
    return 64, 128, 4, 3, split
