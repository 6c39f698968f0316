"""Our Llama / Bamba inference implementations against transformers (float32, eager, CPU).

Tiny random models and the four shipped specialists; the KV goes through a KVCache whose block
allocation order is shuffled (block_size 4, so a sequence spans many non-contiguous blocks), the
Mamba states through an SSMCache. Checked: prefill, one-token decodes, a (K+1)-token verify, a
partial accept, batching (mixed prefill / chunked prefill / decode / verify in one forward equals
each sequence alone), and greedy decoding against generate(do_sample=False).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BambaConfig, LlamaConfig

from specialists.models.batch import ForwardBatch
from specialists.models.loader import load_model, model_from_hf
from state.kv_cache import KVCache
from state.ssm_cache import SSMCache

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ["build", "shell", "cpp", "python"]
NAMES = ["tiny-llama", "tiny-bamba", *SHIPPED]
TOL = 1e-4
DEV = os.environ.get("CANTATA_TEST_DEVICE", "cpu")  # "cuda" on a GPU machine: the same checks there




def _tiny_hf(name: str):
    torch.manual_seed(0)
    common = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
                  pad_token_id=0, eos_token_id=2, bos_token_id=None, rms_norm_eps=1e-5, initializer_range=0.1)
    if name == "tiny-llama":  # head_dim != hidden / heads, biases on, a non-default theta
        cfg = LlamaConfig(**common, num_hidden_layers=2, head_dim=32, attention_bias=True, rope_theta=5000.0)
    else:  # Mamba, attention, Mamba; the 40-token prompt spans two SSD chunks
        cfg = BambaConfig(**common, num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32,
                          mamba_d_state=16, mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=32, mamba_d_conv=4)
    cfg._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval().to(DEV)


@pytest.fixture(scope="module", params=NAMES)
def pair(request):
    name = request.param
    if name in SHIPPED:
        path = ROOT / "deploy" / "models" / name
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval().to(DEV)
        ours = load_model(path, device=DEV, dtype=torch.float32)
    else:
        hf = _tiny_hf(name)
        ours = model_from_hf(hf, device=DEV)
    return name, hf, ours


class Session:
    """One KV pool (+ SSM slots) and the sequences in it; every step commits what it is told."""

    def __init__(self, model, block_size: int = 4, num_blocks: int = 128, num_slots: int = 8, seed: int = 0,
                 check: bool = True):
        self.model = model
        self.check = check
        self.kv = KVCache(model.kv_cache_config(num_blocks, block_size, enable_prefix_cache=False))
        random.Random(seed).shuffle(self.kv.pool._free)  # non-contiguous, unordered block tables
        cfg = model.ssm_cache_config(num_slots)
        self.ssm = SSMCache(cfg) if cfg is not None else None
        self.slot: dict[int, int] = {}

    def add(self, sid: int, prompt: list[int]) -> None:
        assert self.kv.add_sequence(sid, prompt) == 0
        self.slot[sid] = self.ssm.allocate() if self.ssm is not None else -1

    def step(self, work: list[tuple[int, list[int], bool]], accept: dict[int, int] | None = None) -> list[torch.Tensor]:
        """work: (seq_id, new tokens, is_prefill) -> logits of every new token, per sequence."""
        accept = accept or {}
        for sid, toks, _ in work:
            self.kv.reserve(sid, len(toks))
        batch = ForwardBatch.from_kv(self.kv, work, [self.slot[s] for s, _, _ in work], DEV)
        logits = self.model.logits(self.model.forward(batch, self.kv, self.ssm))
        qsl = batch.query_start_loc.tolist()
        for sid, toks, _ in work:
            self.kv.commit(sid, toks, accept.get(sid, len(toks)))
        staged = [(self.slot[s], accept.get(s, len(t))) for s, t, pre in work if not pre]
        if self.ssm is not None and staged:
            self.ssm.commit([s for s, _ in staged], [n for _, n in staged])
        if self.check:
            self.kv.check_invariants()
        return [logits[qsl[b]:qsl[b + 1]] for b in range(len(work))]


@torch.no_grad()
def _hf_logits(hf, ids: list[int]) -> torch.Tensor:  # -> [len(ids), V]
    return hf(torch.tensor([ids], device=DEV)).logits[0]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_prefill_decode_verify_match_transformers(pair) -> None:
    name, hf, ours = pair
    V = hf.config.vocab_size
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(3, V, (50,), generator=g).tolist()
    prompt, decodes, verify = toks[:40], toks[40:43], toks[43:47]
    ref = _hf_logits(hf, toks[:47])
    s = Session(ours, seed=3)
    s.add(0, prompt)
    diffs = {"prefill": _diff(s.step([(0, prompt, True)])[0], ref[:40])}
    diffs["decode"] = max(_diff(s.step([(0, [t], False)])[0], ref[40 + i:41 + i]) for i, t in enumerate(decodes))
    diffs["verify"] = _diff(s.step([(0, verify, False)], accept={0: 2})[0], ref[43:47])
    # only 2 of the 4 verified tokens were kept: the next step must see exactly 45 tokens
    nxt = toks[47]
    ref2 = _hf_logits(hf, toks[:45] + [nxt])
    diffs["after_partial_accept"] = _diff(s.step([(0, [nxt], False)])[0], ref2[45:46])
    print(f"{name}: max |logit diff| vs transformers: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    assert max(diffs.values()) <= TOL, diffs


def test_batch_equals_each_alone(pair) -> None:
    name, hf, ours = pair
    V = hf.config.vocab_size
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (40, 17, 29)]
    extra = [torch.randint(3, V, (n,), generator=g).tolist() for n in (6, 1, 4)]
    # step 2: seq 0 a chunked-prefill continuation, seq 1 a decode, seq 2 a verify
    work2 = [(0, extra[0], True), (1, extra[1], False), (2, extra[2], False)]

    together = Session(ours, seed=5)
    for sid, p in enumerate(prompts):
        together.add(sid, p)
    first = together.step([(sid, p, True) for sid, p in enumerate(prompts)])
    second = together.step(work2)

    worst_alone = worst_hf = 0.0
    for sid, p in enumerate(prompts):
        alone = Session(ours, seed=11 + sid)
        alone.add(sid, p)
        a1 = alone.step([(sid, p, True)])[0]
        a2 = alone.step([work2[sid]])[0]
        worst_alone = max(worst_alone, _diff(first[sid], a1), _diff(second[sid], a2))
        ref = _hf_logits(hf, p + extra[sid])
        worst_hf = max(worst_hf, _diff(first[sid], ref[:len(p)]), _diff(second[sid], ref[len(p):]))
    print(f"{name}: batched vs alone {worst_alone:.2e}, batched vs transformers {worst_hf:.2e}")
    assert worst_alone <= TOL and worst_hf <= TOL


def _prompts(domain: str, tok, n: int = 8, length: int = 64) -> list[list[int]]:
    """The last `length` tokens of the first n prompts that have that many (equal lengths: one
    unpadded batch for generate)."""
    out = []
    for line in (ROOT / "bench" / "data" / domain / "prompts.jsonl").read_text().splitlines():
        if line.strip():
            ids = tok(json.loads(line)["prompt"], add_special_tokens=False)["input_ids"]
            if len(ids) >= length:
                out.append(ids[-length:])
        if len(out) == n:
            break
    assert len(out) == n, f"{domain}: fewer than {n} prompts of {length} tokens"
    return out


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


@pytest.mark.parametrize("domain", SHIPPED)
def test_greedy_matches_generate(domain: str) -> None:
    path = ROOT / "deploy" / "models" / domain
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval().to(DEV)
    ours = load_model(path, device=DEV, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = _prompts(domain, tok)
    eos, new = hf.config.eos_token_id, 64

    # ours: all prompts prefilled in one batch, then one-token greedy decodes, batched
    s = Session(ours, num_blocks=8 * (64 + new) // 4 + 16, seed=7, check=False)
    for sid, p in enumerate(prompts):
        s.add(sid, p)
    last = s.step([(sid, p, True) for sid, p in enumerate(prompts)])
    mine = [[int(lg[-1].argmax())] for lg in last]
    for _ in range(new - 1):
        out = s.step([(sid, [m[-1]], False) for sid, m in enumerate(mine)])
        for m, lg in zip(mine, out):
            m.append(int(lg[-1].argmax()))

    # transformers: one unpadded batch of equal-length prompts
    with torch.no_grad():
        g = hf.generate(torch.tensor(prompts, device=DEV),
                        attention_mask=torch.ones(len(prompts), len(prompts[0]), dtype=torch.long, device=DEV),
                        max_new_tokens=new, do_sample=False, pad_token_id=hf.config.pad_token_id,
                        output_scores=True, return_dict_in_generate=True)
    matches = 0
    for sid, p in enumerate(prompts):
        ref = _until_eos(g.sequences[sid, len(p):].tolist(), eos)
        got = _until_eos(mine[sid], eos)
        if got == ref:
            matches += 1
            continue
        i = next((j for j in range(min(len(got), len(ref))) if got[j] != ref[j]), min(len(got), len(ref)))
        top2 = g.scores[i][sid].topk(2).values if i < len(g.scores) else torch.zeros(2)
        gap = (top2[0] - top2[1]).item()
        print(f"{domain} prompt {sid}: first divergence at new token {i} (ours {got[i:i + 1]}, "
              f"transformers {ref[i:i + 1]}), transformers top-2 logit gap {gap:.2e}")
        assert gap <= 1e-3, f"prompt {sid}: divergence at token {i} is not an fp near-tie (gap {gap})"
    print(f"{domain}: greedy {matches}/{len(prompts)} prompts identical over {new} new tokens")
    assert matches >= 7
