"""bench.acceptance: refusal without a drafter, the result line, and chain_hits against chained drafting."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from bench.acceptance import chain_hits, main
from specialists.models.configs import PRESETS, backbone_config
from specialists.models.mtp import MTPConfig, MTPDrafter, draft_greedy, load_drafter, save_drafter

K = 3
MAX_NEW = 20


def echo_biased_drafter(cfg: MTPConfig, seed: int) -> MTPDrafter:
    """A random drafter whose fused input leans on the token embedding, so that through the tied head it
    tends to predict the token it was fed: random backbones often repeat themselves, so its chains get
    hits at every depth, and misses where the backbone moves on (a drafter that never hits would make acceptance checks vacuous)."""
    torch.manual_seed(seed)
    drafter = MTPDrafter(cfg)
    d = cfg.hidden_size
    with torch.no_grad():
        drafter.proj.weight.mul_(0.5)
        drafter.proj.weight[:, d:] += 3.0 * torch.eye(d)
        drafter.block.o_proj.weight.mul_(0.5)
        drafter.block.down_proj.weight.mul_(0.5)
    return drafter.eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A random llama-micro backbone, a random drafter and a tokenizer trained on stdlib sources."""
    from specialists.train.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("bench")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [f.read_text(encoding="utf-8") for f in sorted((stdlib / "json").glob("*.py"))]
    out = train_tokenizer(texts, 400, root / "model")
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    torch.manual_seed(0)
    config = backbone_config(PRESETS["llama-micro"], len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger than the default init, so greedy decoding does not repeat one token forever
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(out))
    cfg = MTPConfig(hidden_size=config.hidden_size, intermediate_size=PRESETS["llama-micro"].mtp_intermediate_size,
                    num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                    vocab_size=config.vocab_size, num_speculative_tokens=K)
    save_drafter(echo_biased_drafter(cfg, 1), out)
    return out


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [
        {"prompt": "import json\n\ndef load(fp):\n    return", "reference": " json.loads(fp.read())\n"},
        {"prompt": "class JSONDecodeError(ValueError):\n    \"\"\"Subclass", "reference": " of ValueError.\"\"\"\n"},
        {"prompt": "for key, value in items:\n    if"},
        {"prompt": "x = {\"a\": [1, 2, 3], \"b\": None}\nprint(json.dumps(x", "reference": ", indent=2))\n"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def last_json(capsys) -> dict:
    lines = [line for line in capsys.readouterr().out.strip().splitlines() if line.strip()]
    return json.loads(lines[-1])


def test_refuses_without_drafter(model_dir: Path, prompts: Path, tmp_path: Path, capsys) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy2(model_dir / name, bare / name)
    assert main(["--model", str(bare), "--prompts", str(prompts)]) == 2
    assert "mtp.safetensors" in capsys.readouterr().err
    # weights without a config are refused too
    shutil.copy2(model_dir / "mtp.safetensors", bare / "mtp.safetensors")
    assert main(["--model", str(bare), "--prompts", str(prompts)]) == 2
    # and a directory without a backbone
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["--model", str(empty), "--prompts", str(prompts)]) == 2


def expected_acceptance(model_dir: Path, prompts: Path) -> list[float]:
    """a_j recomputed the slow way: generate greedily, then chain draft_greedy at every bonus position."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    drafter = load_drafter(model_dir)
    stop = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    accepted: list[list[int]] = []
    for line in prompts.read_text().splitlines():
        ids = tokenizer(json.loads(line)["prompt"], add_special_tokens=False)["input_ids"]
        x = torch.tensor(ids)
        with torch.no_grad():
            out = model.generate(x[None], attention_mask=torch.ones_like(x)[None], max_new_tokens=MAX_NEW + K,
                                 do_sample=False, eos_token_id=stop, pad_token_id=stop[0])[0]
            hidden = model.model(input_ids=out[None], use_cache=False).last_hidden_state[0]
        for p in range(len(ids), len(ids) + MAX_NEW):  # p: position of the bonus token
            if p + K >= len(out):
                break
            drafts = draft_greedy(drafter, hidden[:p], out[: p + 1], embed, head, K)
            row, ok = [], True
            for j in range(K):
                ok = ok and int(drafts[j]) == int(out[p + 1 + j])
                row.append(int(ok))
            accepted.append(row)
    assert accepted
    return [sum(r[j] for r in accepted) / len(accepted) for j in range(K)]


def test_result_line(model_dir: Path, prompts: Path, tmp_path: Path, capsys) -> None:
    results = tmp_path / "results.jsonl"
    rc = main(["--model", str(model_dir), "--prompts", str(prompts), "--k", str(K), "--max-new-tokens", str(MAX_NEW),
               "--results", str(results)])
    assert rc == 0
    result = last_json(capsys)
    assert set(result) >= {"model", "prompts", "next_token_acc", "acceptance_by_depth", "mean_accepted"}
    assert result["model"] == str(model_dir) and result["prompts"] == 4
    a = result["acceptance_by_depth"]
    assert len(a) == K
    assert result["mean_accepted"] == pytest.approx(sum(a), abs=1e-4)
    assert 1.0 >= a[0] >= a[1] >= a[2] >= 0.0
    assert a[K - 1] > 0.0 and a[0] < 1.0, a  # the drafter hits and misses: the numbers carry information
    assert result["next_token_acc"] is not None and 0.0 <= result["next_token_acc"] <= 1.0
    expected = expected_acceptance(model_dir, prompts)
    assert a == pytest.approx(expected, abs=1e-4)
    row = json.loads(results.read_text().splitlines()[-1])
    assert row["bench"] == "acceptance" and row["k"] == K and row["acceptance_by_depth"] == a


def test_result_line_k1(model_dir: Path, prompts: Path, capsys) -> None:
    assert main(["--model", str(model_dir), "--prompts", str(prompts), "--k", "1", "--max-new-tokens", "8", "--limit", "2"]) == 0
    result = last_json(capsys)
    assert result["prompts"] == 2 and len(result["acceptance_by_depth"]) == 1
    assert result["mean_accepted"] == pytest.approx(result["acceptance_by_depth"][0], abs=1e-4)


# ---- chain_hits ------------------------------------------------------------------------------

V = 32


@pytest.fixture(scope="module")
def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).to(torch.float64).eval()


def tiny_drafter(seed: int) -> MTPDrafter:
    cfg = MTPConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                    num_speculative_tokens=K)
    torch.manual_seed(seed)
    drafter = MTPDrafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return drafter.to(torch.float64).eval()


def reference_hits(model, drafter, ids: torch.Tensor, first: int, last: int, k: int) -> torch.Tensor:
    """[N, k] accepted-prefix flags from chained drafting on each committed prefix alone."""
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    rows = []
    for p in range(first, last + 1):
        with torch.no_grad():
            hidden = model.model(input_ids=ids[None, :p], use_cache=False).last_hidden_state[0]
        drafts = draft_greedy(drafter, hidden, ids[: p + 1], embed, head, k)
        rows.append(drafts == ids[p + 1 : p + 1 + k])
    return torch.stack(rows)


def prefix(hits: torch.Tensor) -> torch.Tensor:
    return hits.long().cumprod(dim=1).bool()


def test_chain_hits_on_greedy_sequence(tiny_llama) -> None:
    drafter = tiny_drafter(2)
    prompt = torch.randint(0, V, (6,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ids = tiny_llama.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=24,
                                  do_sample=False, pad_token_id=0)[0]
    first, last = len(prompt), len(ids) - 1 - K
    hits = chain_hits(tiny_llama, drafter, ids, first, last, K)
    assert hits.shape == (last - first + 1, K) and hits.dtype == torch.bool
    ref = reference_hits(tiny_llama, drafter, ids, first, last, K)
    assert torch.equal(hits[:, 0], ref[:, 0])  # depth 1 is always exact
    assert torch.equal(prefix(hits), prefix(ref))  # deeper depths are exact while the chain is accepted


def test_chain_hits_with_accepted_chains(tiny_llama) -> None:
    """A sequence built from the drafter's own chains (some drafts corrupted), so that hits occur at every
    depth and the comparison is not just False == False."""
    drafter = tiny_drafter(3)
    embed, head = tiny_llama.get_input_embeddings().weight, tiny_llama.get_output_embeddings().weight
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, V, (4,), generator=g)
    while len(ids) < 40:
        with torch.no_grad():
            hidden = tiny_llama.model(input_ids=ids[None, :-1], use_cache=False).last_hidden_state[0]
        drafts = draft_greedy(drafter, hidden, ids, embed, head, K)
        if torch.rand((), generator=g) < 0.5:  # corrupt one draft
            j = int(torch.randint(0, K, (), generator=g))
            drafts[j] = (drafts[j] + 1 + torch.randint(0, V - 1, (), generator=g)) % V
        ids = torch.cat([ids, drafts])
    first, last = 3, len(ids) - 1 - K
    hits = chain_hits(tiny_llama, drafter, ids, first, last, K)
    ref = reference_hits(tiny_llama, drafter, ids, first, last, K)
    assert torch.equal(hits[:, 0], ref[:, 0])
    assert torch.equal(prefix(hits), prefix(ref))
    accepted = prefix(ref).sum(0)
    assert accepted[K - 1] >= 3 and accepted[0] < len(ref), accepted  # full chains and misses both occur
