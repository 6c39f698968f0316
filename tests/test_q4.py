"""quantization="q4": a GGUF-imported checkpoint's products from the file's own blocks (specialists/
ggml_blocks.py, the native kernel's GGML block products). Built here: tiny GGUFs in llama.cpp's layout
(tests/gguf_fixture.py), one like the real SmolLM2 file (every layer product Q4_1, the embedding Q8_0)
and one with the FFN only quantized. Checked: the import keeps the blocks exactly as the file has them
(they dequantize to the saved weights) and an older import gets them on its next run; the kernel's
product equals a float64 reference of the same block arithmetic, padding and all, each row alone; the
engine under q4 agrees with the dense checkpoint and a row's tokens do not depend on the batch; a
checkpoint without blocks refuses q4 and says what to use."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from gguf_fixture import tiny_llama, write_gguf, write_wheel
from policies.policy import SpeculationPolicy
from spec.sampling import SamplingParams
from specialists import ggml_blocks
from specialists.engine import Engine
from specialists.gguf_import import MANIFEST, ImportRequest, run_import
from specialists.ops import native
from test_native import needs_native



def _import(root, every: bool):
    gguf_path = root / f"tiny-{every}.gguf"
    write_gguf(tiny_llama(), gguf_path, every=every)
    data = gguf_path.read_bytes()
    (root / "wheels").mkdir(exist_ok=True)
    wheel = write_wheel(root / "wheels" / "tinyllm-0.1.0-py3-none-any.whl", {"tinyllm/tiny.gguf": data})
    req = ImportRequest(sha256=hashlib.sha256(data).hexdigest(), wheel=wheel, out=root / f"ckpt-{every}",
                        cache_dir=root / f"cache-{every}")
    out, converted = run_import(req)
    assert converted
    return out, req


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    return _import(tmp_path_factory.mktemp("q4"), every=True)


def test_import_keeps_the_files_blocks(q4) -> None:
    out, _ = q4
    manifest = json.loads((out / MANIFEST).read_text())
    assert ggml_blocks.FILE in manifest["files"]
    blocks, dense = ggml_blocks.read(out), load_file(str(out / "model.safetensors"))
    kinds = {name: kind for name, (kind, _) in blocks.items()}
    assert kinds.pop("model.embed_tokens.weight") == "Q8_0"
    assert len(kinds) == 2 * 7 and set(kinds.values()) == {"Q4_1"}
    for name, (kind, raw) in blocks.items():  # the file's values, q/k rows in the checkpoint's order
        assert torch.equal(torch.from_numpy(ggml_blocks.dequantize(kind, raw.numpy())), dense[name]), name


def test_an_older_import_gets_its_blocks_on_the_next_run(q4) -> None:
    out, req = q4
    want = ggml_blocks.read(out)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest.pop("ggml_blocks") is True  # as an import made before the blocks were kept
    del manifest["files"][ggml_blocks.FILE]
    (out / MANIFEST).write_text(json.dumps(manifest))
    (out / ggml_blocks.FILE).unlink()
    assert run_import(req) == (out, False)  # verified, not converted again
    got = ggml_blocks.read(out)
    assert got.keys() == want.keys() and all(got[k][0] == want[k][0] and torch.equal(got[k][1], want[k][1]) for k in want)
    assert ggml_blocks.FILE in json.loads((out / MANIFEST).read_text())["files"]


def _reference(kind: str, raw: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: x rounded to int8 per block of 32 (scale amax / 127, ties to
    even), each block's exact integer sum scaled, plus the Q4_1 minimum's term."""
    M, K = x.shape
    xb = x.view(M, K // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q = torch.round(xb * inv).double()
    sa = torch.where(amax > 0, amax / torch.tensor(127.0), torch.zeros(())).double()
    b = raw.reshape(raw.shape[0], K // 32, -1)
    d = torch.from_numpy(b[..., 0:2].copy().view(np.float16).astype(np.float64))[..., 0]
    if kind == "Q8_0":
        w = torch.from_numpy(b[..., 2:].view(np.int8).astype(np.float64))
        return torch.einsum("mbk,nbk,nb,mb->mn", q, w, d, sa[..., 0])
    m = torch.from_numpy(b[..., 2:4].copy().view(np.float16).astype(np.float64))[..., 0]
    qs = b[..., 4:]
    w = torch.from_numpy(np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float64))
    return (torch.einsum("mbk,nbk,nb,mb->mn", q, w, d, sa[..., 0])
            + torch.einsum("nb,mb->mn", m, sa[..., 0] * q.sum(-1)))


@needs_native
@pytest.mark.parametrize("kind,shape", [("Q4_1", (40, 96)), ("Q4_1", (576, 1536)), ("Q8_0", (1000, 576))])
def test_block_product_equals_the_reference_and_rows_are_independent(kind, shape) -> None:
    import gguf

    torch.manual_seed(0)
    N, K = shape
    raw = gguf.quants.quantize(torch.randn(N, K).numpy(), getattr(gguf.GGMLQuantizationType, kind))
    x = torch.randn(6, K)
    x[2, :32] = 0  # an all-zero block
    packed = ggml_blocks.pack(kind, raw)
    got = native.blinear(x, ggml_blocks.kernel_type(kind), packed, N)
    want = _reference(kind, raw, x)
    assert got.shape == (6, N)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6
    alone = torch.cat([native.blinear(x[i:i + 1], ggml_blocks.kernel_type(kind), packed, N) for i in range(6)])
    assert torch.equal(got, alone)


PROMPTS = [[5, 17, 300, 41, 9], [100, 2000, 33], [7, 7, 7, 1234, 56, 78, 90, 12]]


@needs_native
def test_q4_engine_agrees_with_the_dense_weights_and_rows_are_exact(q4) -> None:
    out, _ = q4
    off = SpeculationPolicy(mode="off")
    dense = Engine.from_pretrained(out, policy=off, quantization="none")
    eng = Engine.from_pretrained(out, policy=off, quantization="q4")
    assert eng.cfg.quantization == "q4" and eng.quantized == 2 * 4 + 1 and eng.runner.row_exact
    assert eng.runner.model.native is not None and not eng.runner.model.native.fp32
    hidden = torch.randn(3, dense.runner.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    a, b = (e.runner.model.logits(hidden) for e in (dense, eng))  # the Q8_0 head alone
    assert ((a - b).norm() / a.norm()).item() < 0.02
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    alone = [eng.generate([p], params)[0].token_ids for p in PROMPTS]
    together = [o.token_ids for o in eng.generate(PROMPTS, params)]
    assert together == alone
    ref = [o.token_ids for o in dense.generate(PROMPTS, params)]
    agree = sum(x == y for r, g in zip(ref, alone) for x, y in zip(r, g)) / sum(map(len, ref))
    assert agree > 0.5, (ref, alone)


def test_without_blocks_q4_is_refused_and_auto_does_not_pick_it(tmp_path) -> None:
    out, _ = _import(tmp_path, every=False)  # the attention products are F32: no blocks kept
    assert not (out / ggml_blocks.FILE).exists()
    manifest = json.loads((out / MANIFEST).read_text())
    assert ggml_blocks.FILE not in manifest["files"] and manifest["ggml_blocks"] is False
    with pytest.raises(ValueError, match="use 'int8'"):
        Engine.from_pretrained(out, policy=SpeculationPolicy(mode="off"), quantization="q4")
    assert Engine.from_pretrained(out, policy=SpeculationPolicy(mode="off")).cfg.quantization == "none"  # 0.6M params
