"""The Qwen2 family (Llama with q/k/v biases, o_proj without) in our loader, against transformers'
Qwen2ForCausalLM: a tiny random Qwen2 (random, non-zero biases; rope_theta 1e6, rms_norm_eps 1e-6 as
Qwen2 ships them; tied and untied heads) saved as a safetensors checkpoint with the shell
specialist's tokenizer. Checked: logits over prefill / decode / verify, the engine's greedy tokens,
and that a sliding-window config is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, Qwen2Config, Qwen2ForCausalLM

from checkpoint_parity import TOL, copy_tokenizer, greedy_pairs, hf_model, max_logit_diff
from specialists.engine import Engine
from specialists.models.llama import LlamaModel
from specialists.models.loader import UnsupportedModelError, check_supported, load_model


def _config(tied: bool, **kw) -> Qwen2Config:
    return Qwen2Config(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                       rms_norm_eps=1e-6, initializer_range=0.1, pad_token_id=0, eos_token_id=2, **kw)


def _save_tiny_qwen2(path, tied: bool):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(_config(tied)).float().eval()
    with torch.no_grad():  # transformers initializes biases to zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    model.save_pretrained(path)
    copy_tokenizer(path)
    return model


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def qwen2_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"qwen2-{'tied' if request.param else 'untied'}")
    _save_tiny_qwen2(path, request.param)
    return path


def test_qwen2_checkpoint_has_the_qwen2_layout(qwen2_dir) -> None:
    hf = hf_model(qwen2_dir)
    attn = hf.model.layers[0].self_attn
    assert hf.config.model_type == "qwen2" and attn.o_proj.bias is None
    assert all(p.bias.abs().sum() > 0 for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    ours = load_model(qwen2_dir)
    assert ours.layers[0].attn.qkv_bias is not None and ours.layers[0].attn.o_bias is None
    assert (ours.lm_head is ours.embed) == hf.config.tie_word_embeddings


def test_qwen2_logits_match_transformers(qwen2_dir) -> None:
    hf = hf_model(qwen2_dir)
    diff = max_logit_diff(qwen2_dir, hf)
    print(f"{qwen2_dir.name}: max |logit diff| vs transformers {diff:.2e}")
    assert diff <= TOL
    with torch.no_grad():  # the check can fail: without the q/k/v biases the logits are far off
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    assert max_logit_diff(qwen2_dir, hf) > 100 * TOL


def test_qwen2_engine_greedy_matches_generate(qwen2_dir) -> None:
    g = torch.Generator().manual_seed(4)
    prompts = torch.randint(3, 4096, (3, 20), generator=g).tolist()
    pairs = greedy_pairs(qwen2_dir, prompts, new=24)
    for i, (mine, ref) in enumerate(pairs):
        assert len(mine) == 24 and mine == ref, f"prompt {i}: engine {mine} != transformers {ref}"


def test_sliding_window_is_refused(tmp_path) -> None:
    cfg = _config(True, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        check_supported(cfg)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    copy_tokenizer(tmp_path)
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        Engine.from_pretrained(tmp_path)
    assert check_supported(_config(True, use_sliding_window=False, sliding_window=16)) is LlamaModel


def test_unknown_family_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="'mistral' is not supported"):
        check_supported(MistralConfig())
