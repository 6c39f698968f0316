"""The four shipped specialists: layout, size budget, provenance, template, and that they work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench import acceptance
from specialists.chat import SPECIAL_TOKENS, render
from specialists.models.configs import DEFAULT_PRESET, PRESETS
from specialists.models.mtp import load_drafter
from specialists.train.domains import DOMAINS
from specialists.train.tools import tools_for

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "deploy" / "models"


def test_all_four_ship_within_32_mib() -> None:
    total = sum(f.stat().st_size for d in DOMAINS for f in (MODELS / d).iterdir() if f.is_file())
    assert total <= 32 * 2**20, f"{total / 2**20:.1f} MiB"
    families = {json.loads((MODELS / d / "config.json").read_text())["model_type"] for d in DOMAINS}
    assert families == {"llama", "bamba"}
    hybrids = [d for d in DOMAINS if json.loads((MODELS / d / "config.json").read_text())["model_type"] == "bamba"]
    assert len(hybrids) >= 2


@pytest.mark.parametrize("domain", DOMAINS)
def test_layout_dtype_and_provenance(domain: str) -> None:
    d = MODELS / domain
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "mtp.safetensors", "mtp_config.json", "cantata.json"):
        assert (d / name).is_file(), name
    assert not list(d.glob("*.bin")) and not list(d.glob("*.pt")), "only safetensors ship"
    for name in ("model.safetensors", "mtp.safetensors"):
        with safe_open(str(d / name), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}, name
    meta = json.loads((d / "cantata.json").read_text())
    assert meta["domain"] == domain and meta["preset"] == DEFAULT_PRESET[domain]
    assert meta["family"] == PRESETS[DEFAULT_PRESET[domain]].family
    for key in ("corpus_sha256", "tokenizer_sha256", "commit", "device"):
        assert meta[key], key
    assert meta["backbone"]["tokens_seen"] > 10_000_000 and meta["backbone"]["steps"] > 100
    assert meta["mtp"]["beats_bigram"] and meta["mtp"]["sanity"]["val_a1_tf"] > meta["mtp"]["sanity"]["val_bigram_a1"]


@pytest.mark.parametrize("domain", DOMAINS)
def test_chat_template_in_tokenizer_config_matches_render(domain: str) -> None:
    d = MODELS / domain
    assert "chat_template" in json.loads((d / "tokenizer_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(d))
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(len(SPECIAL_TOKENS)))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "help"}]
    tools = tools_for(domain)
    expected = render(messages, tools, add_generation_prompt=True)
    assert tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False) == expected


@pytest.mark.slow
@pytest.mark.parametrize("domain", DOMAINS)
def test_shipped_drafter_accepts(domain: str, capsys: pytest.CaptureFixture) -> None:
    """A smoke floor well under the measured figures (README): broken weights fail it."""
    rc = acceptance.main(["--model", str(MODELS / domain), "--prompts", str(ROOT / "bench" / "data" / domain / "prompts.jsonl"),
                          "--limit", "4", "--max-new-tokens", "32"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("loaded checkpoint:")
    result = json.loads(out[-1])
    assert result["acceptance_by_depth"][0] >= 0.5, result
    assert result["next_token_acc"] >= 0.3, result


@pytest.mark.slow
@pytest.mark.parametrize("domain", ["cpp", "shell"])
def test_shipped_model_calls_a_tool(domain: str) -> None:
    d = MODELS / domain
    tok = AutoTokenizer.from_pretrained(str(d))
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    row = json.loads((ROOT / "bench" / "data" / domain / "tool_convs.jsonl").read_text().splitlines()[0])
    ids = tok(render(row["messages"], row["tools"], add_generation_prompt=True), add_special_tokens=False, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=96, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    from specialists.chat import parse_tool_calls, validate_arguments

    _, calls = parse_tool_calls(tok.decode(out[0, ids["input_ids"].shape[1]:]))
    assert calls and calls[0].error is None
    tool = next(t for t in row["tools"] if t["function"]["name"] == calls[0].name)
    assert validate_arguments(calls[0].arguments, tool) is None
    assert load_drafter(d).cfg.num_speculative_tokens == 3
