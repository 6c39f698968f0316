"""Shared by tests/test_qwen2.py and tests/test_gguf_import.py: a checkpoint directory against
transformers, float32 on CPU. Our model's logits over a prefill, one-token decodes and a 4-token
verify through a paged KV cache; the engine's greedy tokens against generate(do_sample=False)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from specialists.engine import Engine
from specialists.models.batch import ForwardBatch
from specialists.models.loader import load_model
from specialists.sampling import SamplingParams
from state.kv_cache import KVCache

ROOT = Path(__file__).resolve().parents[1]
SHELL = ROOT / "deploy" / "models" / "shell"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TOL = 1e-4


def copy_tokenizer(dest: Path, source: Path = SHELL) -> None:
    """The shipped shell specialist's tokenizer (4096 tokens, ChatML template) into dest."""
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, dest / name)


def hf_model(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def ours_logits(model, toks: list[int], prompt_len: int, decodes: int) -> torch.Tensor:
    """Logits [len(toks) - 1 ... ] of our model: toks[:prompt_len] prefilled (every position's
    logits), then `decodes` one-token steps, then the rest of toks as one verify step."""
    kv = KVCache(model.kv_cache_config(num_blocks=64, block_size=4, enable_prefix_cache=False))
    assert kv.add_sequence(0, toks[:prompt_len]) == 0
    steps = [(toks[:prompt_len], True)] + [([t], False) for t in toks[prompt_len:prompt_len + decodes]]
    steps.append((toks[prompt_len + decodes:], False))
    out = []
    for new, prefill in steps:
        kv.reserve(0, len(new))
        batch = ForwardBatch.from_kv(kv, [(0, new, prefill)], None, "cpu")
        hidden = model.forward(batch, kv)  # [T, d]
        out.append(model.logits(hidden if prefill else hidden[batch.logits_indices]))
        kv.commit(0, new, len(new))
    return torch.cat(out)


@torch.no_grad()
def max_logit_diff(path: Path, hf=None, seed: int = 1) -> float:
    """max |our logits - transformers'| over 44 random tokens (30 prefilled, 6 decodes, 8 verified)."""
    hf = hf if hf is not None else hf_model(path)
    ours = load_model(path, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(3, hf.config.vocab_size, (44,), generator=g).tolist()
    ref = hf(torch.tensor([toks])).logits[0]  # [44, V]
    mine = ours_logits(ours, toks, 30, 6)
    assert mine.shape == ref.shape, (mine.shape, ref.shape)
    return (mine - ref).abs().max().item()


@torch.no_grad()
def greedy_pairs(path: Path, prompts: list[list[int]], new: int = 24, hf=None) -> list[tuple[list[int], list[int]]]:
    """(engine's greedy tokens, transformers' generate tokens) per prompt; EOS ignored on both sides.
    The prompts must have equal lengths (one unpadded batch for generate)."""
    hf = hf if hf is not None else hf_model(path)
    hf.generation_config.eos_token_id = None
    eng = Engine.from_pretrained(path, device="cpu", dtype=torch.float32, num_blocks=128, max_num_seqs=8)
    outs = eng.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    ids = torch.tensor(prompts)
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                      pad_token_id=hf.config.pad_token_id)
    return [(o.token_ids, r[ids.shape[1]:].tolist()) for o, r in zip(outs, ref)]
