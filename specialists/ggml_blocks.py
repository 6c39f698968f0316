"""A GGUF's own quantized blocks, kept for `quantization="q4"` (specialists/quantize.py).

The import (specialists/gguf_import.py) dequantizes a GGUF into a dense checkpoint; that is a second
rounding of the model llama.cpp runs as soon as we quantize again (int8). So the import also writes
`ggml_blocks.safetensors` beside the weights: every product weight of the file that is Q4_1 (a block of
32 inputs: fp16 d and m, 32 4-bit q; value d q + m) or Q8_0 (fp16 d, 32 int8 q; value d q), its blocks
as they are in the file (uint8 [rows, blocks x bytes]), under the checkpoint's tensor names, rows in
the checkpoint's order (llama.cpp's converter interleaves a Llama's q/k rows for its rope: undone here).
Only safetensors are loaded as weights: the GGUF itself is read at import time only. The file is
written only when every product of every layer has one of those types and its dequantized values
equal the dense checkpoint's (checked at import), else not at all (q4 then falls back to int8).

`pack` lays a weight's blocks out for the native kernel (specialists/ops/native/cantata_cpu.c, GGML
block weights): groups of 16 output rows, per block of 32 inputs the 16 rows' quants, then their
scales. `dequantize` gives the values the blocks stand for (tests, the import's check).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["FILE", "TYPES", "extract", "write", "write_for_import", "add_to_import", "read", "pack", "dequantize"]

log = logging.getLogger(__name__)

FILE = "ggml_blocks.safetensors"
TYPES = {"Q4_1": (1, 20), "Q8_0": (2, 34)}  # name -> (the kernel's block type, bytes per block of 32)
QB = 32
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}


def _hf_name(name: str) -> str | None:
    """blk.3.ffn_up.weight -> model.layers.3.mlp.up_proj.weight; token_embd / output likewise; else None."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.weight"
    return None


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (per head, rotate-half pairs adjacent) -> the checkpoint's (halves)."""
    n = rows.shape[0]
    d = n // heads
    idx = np.arange(n).reshape(heads, d // 2, 2).transpose(0, 2, 1).reshape(n)
    return rows[idx]


def extract(gguf_path: Path) -> dict[str, tuple[str, np.ndarray]] | None:
    """checkpoint name -> (type name, blocks uint8 [rows, blocks x bytes]) for every Q4_1 / Q8_0 product
    of the file, or None when some layer product has another type (then none is kept)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field else ""
    heads = {k: int(reader.fields[f"{arch}.attention.{k}"].parts[-1][0])
             for k in ("head_count", "head_count_kv") if f"{arch}.attention.{k}" in reader.fields}
    out: dict[str, tuple[str, np.ndarray]] = {}
    for t in reader.tensors:
        hf = _hf_name(t.name)
        if hf is None:
            continue
        kind = t.tensor_type.name
        if kind not in TYPES:
            if hf.startswith("model.layers."):
                log.info("%s is %s: no GGML blocks kept (q4 needs Q4_1 / Q8_0 products)", t.name, kind)
                return None
            continue  # an embedding or head of another type: int8 serves it
        blocks = np.asarray(t.data, dtype=np.uint8).reshape(int(t.shape[-1]), -1)
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            blocks = _unpermute(blocks, heads["head_count" if "attn_q" in t.name else "head_count_kv"])
        out[hf] = (kind, np.ascontiguousarray(blocks))
    return out


def dequantize(kind: str, blocks: np.ndarray) -> np.ndarray:
    """The fp32 values [rows, K] the blocks stand for (fp16 scales widened, d q + m rounded once)."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, TYPES[kind][1])
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
    if kind == "Q8_0":
        return (d * b[..., 2:].view(np.int8).astype(np.float32)).reshape(rows, -1)
    m = b[..., 2:4].copy().view(np.float16).astype(np.float32)
    qs = b[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
    return (d * q + m).reshape(rows, -1)


def write(gguf_path: Path, dest: Path, dense: dict[str, torch.Tensor]) -> bool:
    """dest/FILE from the GGUF, if its products qualify and dequantize to `dense` (the checkpoint's
    tensors, compared in their dtype) -> whether it was written."""
    from safetensors.numpy import save_file

    found = extract(gguf_path)
    if not found:
        return False
    tensors, types = {}, {}
    for name, (kind, blocks) in found.items():
        ref = dense.get(name)
        if ref is None and name == "lm_head.weight":  # a tied head the checkpoint does not store
            continue
        values = None if ref is None else torch.from_numpy(dequantize(kind, blocks)).to(ref.dtype)
        if values is None or values.shape != ref.shape or not torch.equal(values, ref):
            log.warning("%s: the GGUF's %s blocks do not give the checkpoint's values: no GGML blocks kept", name, kind)
            return False
        tensors[name], types[name] = blocks, kind
    save_file(tensors, str(dest / FILE), metadata={"format": "ggml-blocks", **types})
    return True


def read(checkpoint: Path) -> dict[str, tuple[str, torch.Tensor]] | None:
    """checkpoint/FILE -> name -> (type name, blocks), or None without one."""
    from safetensors import safe_open

    path = Path(checkpoint) / FILE
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != "ggml-blocks":
            raise ValueError(f"{path}: not a GGML blocks file")
        return {k: (meta[k], f.get_tensor(k)) for k in f.keys()}


def pack(kind: str, blocks: np.ndarray | torch.Tensor) -> torch.Tensor:
    """blocks [N, nb x bytes] (the file's) -> the kernel's layout, uint8 [ceil(N / 16), nb, bytes of a
    group-block]; rows padded to 16 with zero blocks. Q4_1: per group-block 4 x 16 x 4 nibble-pair bytes,
    then 16 d and 16 m (fp16). Q8_0: 8 x 16 x 4 int8, 16 d (fp16), 16 c = -128 d sum(q) (fp32)."""
    b = blocks.numpy() if isinstance(blocks, torch.Tensor) else blocks
    n, nbytes = b.shape[0], TYPES[kind][1]
    b = b.reshape(n, -1, nbytes)
    pad = -n % 16
    if pad:
        b = np.concatenate([b, np.zeros((pad, *b.shape[1:]), np.uint8)])
    g, nb = b.shape[0] // 16, b.shape[1]
    b = b.reshape(g, 16, nb, nbytes).transpose(0, 2, 1, 3)  # [G, nb, 16 rows, bytes]
    d = b[..., 0:2].reshape(g, nb, 32)
    if kind == "Q4_1":
        qs = b[..., 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(g, nb, 16, 4, 2, 4)  # row, j, lo/hi, i
        nib = (q[..., 0, :] | (q[..., 1, :] << 4)).transpose(0, 1, 3, 2, 4).reshape(g, nb, 256)
        out = np.concatenate([nib, d, b[..., 2:4].reshape(g, nb, 32)], axis=-1)
    else:
        q = b[..., 2:].view(np.int8)
        vec = q.reshape(g, nb, 16, 8, 4).transpose(0, 1, 3, 2, 4).reshape(g, nb, 512).view(np.uint8)
        scale = b[..., 0:2].copy().view(np.float16).astype(np.float64)[..., 0]
        c = (-128.0 * scale * q.astype(np.int64).sum(-1)).astype(np.float32).view(np.uint8).reshape(g, nb, 64)
        out = np.concatenate([vec, d, c], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(out))


def kernel_type(kind: str) -> int:
    return TYPES[kind][0]


def fuse(parts: list[tuple[str, Any]]) -> tuple[str, np.ndarray]:
    """Blocks of a fused product (q | k | v, gate | up): one type, rows concatenated."""
    kinds = {k for k, _ in parts}
    if len(kinds) != 1:
        raise ValueError(f"a fused product mixes block types {sorted(kinds)}")
    return kinds.pop(), np.concatenate([np.asarray(b) for _, b in parts])


def write_for_import(gguf: Path, dest: Path) -> bool:
    """The import's step: dest/FILE from the GGUF where it qualifies (write), checked against dest's
    saved weights -> whether it was written."""
    from safetensors.torch import load_file

    wrote = write(gguf, dest, load_file(str(dest / "model.safetensors")))
    log.info("%s: %s", gguf.name, f"kept its blocks in {FILE}" if wrote else "no GGML blocks kept (q4 unavailable)")
    return wrote


def add_to_import(out: Path, manifest_name: str, find_gguf: Callable[[], Any]) -> None:
    """An import made before GGML blocks were kept gets them now, from its cached GGUF (find_gguf: the
    checked source, or None), and its manifest lists them; nothing when the manifest already decided
    (at the import, or an earlier upgrade) or the GGUF is no longer cached."""
    from specialists.gguf_import import sha256_file

    manifest_path = out / manifest_name
    manifest = json.loads(manifest_path.read_text())
    if "ggml_blocks" in manifest:
        return
    hit = find_gguf()
    if hit is None:
        log.info("%s: the GGUF is no longer cached: no GGML blocks (q4 unavailable; --force re-imports)", out)
        return
    wrote = write_for_import(hit.path, out)
    if wrote:
        path = out / FILE
        path.chmod(0o644)
        manifest["files"][FILE] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    manifest["ggml_blocks"] = wrote
    tmp = manifest_path.with_name(manifest_name + ".part")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, manifest_path)
