"""Training: the schedule, the batch sampler, and backbone + drafter training end to end on CPU."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from specialists.train import export, trainer
from specialists.train.data import TokenStreams, sample_batch
from specialists.train.schedule import CosineWithFloor

DOMAIN = "python"
STEPS = 150
MTP_STEPS = 150


# ---- schedule --------------------------------------------------------------------------------


def test_cosine_warmup_floor_and_end() -> None:
    s = CosineWithFloor(peak_lr=1e-3, total_steps=200, warmup_steps=20, floor_ratio=0.1)
    floor = 1e-4
    lrs = [s.lr(i) for i in range(201)]
    warm = lrs[:20]
    assert all(b > a for a, b in zip(warm, warm[1:]))  # warm-up rises
    assert warm[0] > 0 and math.isclose(lrs[19], 1e-3)
    assert max(lrs) <= 1e-3 + 1e-12
    after = lrs[20:]
    assert all(b <= a + 1e-15 for a, b in zip(after, after[1:]))  # decays monotonically
    assert all(lr >= floor - 1e-15 for lr in lrs)  # never below the floor, never zero
    assert math.isclose(s.lr(200), floor, rel_tol=1e-9)
    assert math.isclose(s.lr(10_000), floor, rel_tol=1e-9)
    assert not s.done(199, 0.0) and s.done(200, 0.0)


def test_cosine_time_budget_ends_schedule() -> None:
    s = CosineWithFloor(peak_lr=2e-3, total_steps=10_000, warmup_steps=10, floor_ratio=0.2, time_budget_s=60.0)
    assert not s.done(50, 30.0)
    assert 0.2 * 2e-3 < s.lr(50, 30.0) < 2e-3
    assert math.isclose(s.lr(50, 30.0), s.lr(5000, 0.0))  # half the time == half the steps
    assert s.done(50, 60.0) and s.done(50, 61.0)
    assert math.isclose(s.lr(50, 60.0), 0.2 * 2e-3)
    assert math.isclose(s.lr(50, 120.0), 0.2 * 2e-3)  # never below the floor past the budget
    # without a budget, elapsed time does not matter
    assert not CosineWithFloor(1e-3, 100, 10).done(50, 1e9)


# ---- batches ---------------------------------------------------------------------------------


def synthetic_streams() -> TokenStreams:
    rng = np.random.default_rng(0)
    text = rng.integers(10, 500, 5000).astype(np.uint16)
    chat_parts, mask_parts, starts, pos = [], [], [], 0
    for c in range(40):
        n = int(rng.integers(20, 80))
        ids = rng.integers(10, 500, n).astype(np.uint16)
        ids[0] = 3  # a marker at every conversation start
        ids[-1] = 0
        m = np.zeros(n, np.uint8)
        m[2::3] = 1  # "assistant" tokens spread through the conversation
        chat_parts.append(ids)
        mask_parts.append(m)
        starts.append(pos)
        pos += n
    return TokenStreams(text, np.concatenate(chat_parts), np.concatenate(mask_parts), np.asarray(starts, np.int64))


def test_sample_batch_deterministic_and_shifted() -> None:
    streams = synthetic_streams()
    a = sample_batch(streams, 8, 32, 0.5, seed=7, step=3)
    b = sample_batch(streams, 8, 32, 0.5, seed=7, step=3)
    c = sample_batch(streams, 8, 32, 0.5, seed=7, step=4)
    d = sample_batch(streams, 8, 32, 0.5, seed=8, step=3)
    for x, y in ((a.inputs, b.inputs), (a.labels, b.labels), (a.loss_mask, b.loss_mask)):
        assert torch.equal(x, y)
    assert not torch.equal(a.inputs, c.inputs) and not torch.equal(a.inputs, d.inputs)
    assert a.inputs.shape == a.labels.shape == a.loss_mask.shape == (8, 32)
    assert a.inputs.dtype == torch.int64 and a.loss_mask.dtype == torch.float32
    assert torch.equal(a.inputs[:, 1:], a.labels[:, :-1])  # labels are the next tokens


def test_sample_batch_chat_rows() -> None:
    streams = synthetic_streams()
    starts = set(int(s) for s in streams.chat_starts)
    chat = np.asarray(streams.chat, dtype=np.int64)
    text = np.asarray(streams.text, dtype=np.int64)
    for step in range(5):
        batch = sample_batch(streams, 8, 32, 0.5, seed=1, step=step)
        for row in range(8):
            seq = np.concatenate([batch.inputs[row].numpy(), batch.labels[row, -1:].numpy()])
            mask = batch.loss_mask[row].numpy()
            if row < 4:  # chat rows come first
                assert seq[0] == 3  # starts at a conversation start
                offs = [o for o in starts if np.array_equal(chat[o : o + 33], seq)]
                assert offs, "chat row is not a window at a conversation start"
                np.testing.assert_array_equal(mask, streams.chat_mask[offs[0] + 1 : offs[0] + 33])
                assert 0 < mask.sum() < 32
            else:
                assert np.all(mask == 1.0)
                windows = np.lib.stride_tricks.sliding_window_view(text, 33)
                assert (windows == seq).all(axis=1).any()
    # no chat rows when chat_fraction is 0, all chat rows when 1
    assert float(sample_batch(streams, 4, 32, 0.0, 1, 0).loss_mask.min()) == 1.0
    all_chat = sample_batch(streams, 4, 32, 1.0, 1, 0)
    assert bool((all_chat.inputs[:, 0] == 3).all())


# ---- end to end ------------------------------------------------------------------------------


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for pkg in ("json", "email", "logging"):
        files += sorted((root / pkg).rglob("*.py"))
    return [f for f in files if f.stat().st_size > 2000]


def conversations(texts: list[str]) -> list[list[dict]]:
    convs = []
    for text in texts:
        for name, args in re.findall(r"^\s*def (\w+)\(([^)]*)\)", text, flags=re.M):
            convs.append([
                {"role": "user", "content": f"What is the signature of {name}?"},
                {"role": "assistant", "content": f"def {name}({args}):"},
            ])
    return convs


def pack_split(tokenizer, texts: list[str], convs: list[list[dict]], folder: Path) -> dict:
    from specialists.train.tokenizer import encode_conversation

    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text = np.concatenate([np.asarray(ids + [eot], np.uint16) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]])
    ids_all, mask_all, starts, total = [], [], [], 0
    for messages in convs:
        ids, mask = encode_conversation(tokenizer, messages)
        starts.append(total)
        ids_all.append(np.asarray(ids + [eot], np.uint16))
        mask_all.append(np.asarray(mask + [0], np.uint8))
        total += len(ids) + 1
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {"text": text, "chat": np.concatenate(ids_all), "chat_mask": np.concatenate(mask_all), "chat_starts": np.asarray(starts, np.int64)}
    for name, arr in arrays.items():
        np.save(folder / f"{name}.npy", arr)
    return {"text_tokens": int(text.shape[0]), "chat_tokens": int(arrays["chat"].shape[0]), "conversations": len(starts)}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict:
    """A tokenizer trained on stdlib sources and a packed `python` domain (train + validation)."""
    from specialists.train.tokenizer import load_tokenizer, train_tokenizer

    root = tmp_path_factory.mktemp("e2e")
    files = stdlib_files()
    texts = [f.read_text(encoding="utf-8") for f in files]
    val_texts = texts[::6]
    train_texts = [t for i, t in enumerate(texts) if i % 6]
    tok_dir = train_tokenizer(train_texts, 512, root / "tokenizer")
    tokenizer = load_tokenizer(tok_dir)
    convs = conversations(texts)
    packed = root / "packed"
    summary = {
        "train": pack_split(tokenizer, train_texts, [c for i, c in enumerate(convs) if i % 6], packed / DOMAIN / "train"),
        "validation": pack_split(tokenizer, val_texts, convs[::6], packed / DOMAIN / "validation"),
    }
    manifest = {
        "corpus_sha256": hashlib.sha256("".join(texts).encode()).hexdigest(),
        "tokenizer_sha256": hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest(),
        "domains": {DOMAIN: summary},
    }
    (packed / "manifest.json").write_text(json.dumps(manifest))
    return {"root": root, "tokenizer": tok_dir, "packed": packed, "manifest": manifest, "vocab": len(tokenizer)}


COMMON = ["--domain", DOMAIN, "--batch-size", "8", "--seq-len", "128", "--device", "cpu", "--warmup", "10",
          "--eval-every", "50", "--eval-batches", "2"]


def train_backbone(ws: dict, preset: str, out: Path) -> dict:
    rc = trainer.cli(["backbone", *COMMON, "--data", str(ws["packed"]), "--tokenizer", str(ws["tokenizer"]), "--out", str(out),
                      "--preset", preset, "--steps", str(STEPS), "--save-every", "1000"])
    assert rc == 0
    return json.loads((out / "backbone_result.json").read_text())


def train_mtp(ws: dict, out: Path, steps: int) -> dict:
    rc = trainer.cli(["mtp", *COMMON, "--data", str(ws["packed"]), "--out", str(out), "--steps", str(steps), "--k", "3",
                      "--sanity-steps", "50", "--save-every", "50"])
    assert rc == 0
    return json.loads((out / "mtp_result.json").read_text())


@pytest.fixture(scope="module")
def llama_run(workspace) -> dict:
    out = workspace["root"] / "run-llama"
    backbone = train_backbone(workspace, "llama-micro", out)
    mtp = train_mtp(workspace, out, MTP_STEPS)
    return {"out": out, "backbone": backbone, "mtp": mtp}


def assert_backbone_learned(result: dict, ws: dict, out: Path, family: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert result["steps"] == STEPS and result["tokens_seen"] == STEPS * 8 * 128
    assert result["family"] == family and result["device"] == "cpu"
    first = result["history"][0]
    assert first["step"] == 50
    final = result["final"]
    uniform = math.log(ws["vocab"])
    assert final["val_text_loss"] < first["val_text_loss"] - 0.3, (first, final)
    assert final["val_text_loss"] < uniform - 1.5, (uniform, final)
    assert final["val_chat_loss"] < uniform - 1.5, (uniform, final)
    model = AutoModelForCausalLM.from_pretrained(str(out / "backbone"))
    assert model.config.model_type == family
    assert model.config.vocab_size == ws["vocab"]
    tok = AutoTokenizer.from_pretrained(str(out / "backbone"))
    assert len(tok) == ws["vocab"]


@pytest.mark.slow
def test_backbone_llama_learns(llama_run, workspace) -> None:
    assert_backbone_learned(llama_run["backbone"], workspace, llama_run["out"], "llama")


@pytest.mark.slow
def test_backbone_bamba_learns(workspace) -> None:
    out = workspace["root"] / "run-bamba"
    result = train_backbone(workspace, "bamba-micro", out)
    assert_backbone_learned(result, workspace, out, "bamba")


@pytest.mark.slow
def test_mtp_beats_bigram(llama_run) -> None:
    result = llama_run["mtp"]
    assert result["steps"] == MTP_STEPS and result["k"] == 3
    assert result["beats_bigram"] is True
    sanity = result["sanity"]
    assert sanity["step"] == 50
    assert sanity["val_a1_tf"] > sanity["val_bigram_a1"]
    final = result["final"]
    assert final["val_a1_tf"] >= final["val_a2_tf"] >= final["val_a3_tf"]
    assert final["val_a1_tf"] > final["val_bigram_a1"]
    out = llama_run["out"]
    assert (out / "backbone" / "mtp.safetensors").is_file() and (out / "backbone" / "mtp_config.json").is_file()
    assert json.loads((out / "mtp_state" / "state.json").read_text())["step"] == MTP_STEPS


@pytest.mark.slow
def test_mtp_resumes(llama_run, workspace, tmp_path, caplog) -> None:
    out = tmp_path / "run"
    shutil.copytree(llama_run["out"], out)
    caplog.set_level(logging.INFO, logger="specialists.train.trainer")
    result = train_mtp(workspace, out, MTP_STEPS + 50)
    assert f"resumed {DOMAIN}/mtp at step {MTP_STEPS}" in caplog.text
    assert result["steps"] == MTP_STEPS + 50
    assert result["tokens_seen"] == (MTP_STEPS + 50) * 8 * 128
    assert [h["step"] for h in result["history"]] == [MTP_STEPS + 50]  # only the new steps ran
    assert json.loads((out / "mtp_state" / "state.json").read_text())["step"] == MTP_STEPS + 50
    assert result["sanity"]["step"] == 50, "a resumed run keeps the sanity record of the first run"


@pytest.fixture(scope="module")
def exported(llama_run, workspace) -> Path:
    out = workspace["root"] / "export"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CANTATA_COMMIT", "abc1234")
        rc = export.cli(["--run", str(llama_run["out"]), "--tokenizer", str(workspace["tokenizer"]),
                         "--packed", str(workspace["packed"]), "--out", str(out)])
    assert rc == 0
    return out


@pytest.mark.slow
def test_export_layout(exported, llama_run, workspace) -> None:
    for name in ("config.json", "model.safetensors", "mtp.safetensors", "mtp_config.json", "tokenizer.json",
                 "tokenizer_config.json", "cantata.json"):
        assert (exported / name).is_file(), name
    assert not (exported / "chat_template.jinja").exists()
    for name in ("model.safetensors", "mtp.safetensors"):
        with safe_open(str(exported / name), "pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        assert dtypes == {"BF16"}, (name, dtypes)
    config = json.loads((exported / "tokenizer_config.json").read_text())
    assert config.get("chat_template")
    meta = json.loads((exported / "cantata.json").read_text())
    assert meta["domain"] == DOMAIN and meta["commit"] == "abc1234" and meta["device"] == "cpu"
    assert meta["corpus_sha256"] == workspace["manifest"]["corpus_sha256"]
    assert meta["tokenizer_sha256"] == workspace["manifest"]["tokenizer_sha256"]
    assert meta["packed"] == workspace["manifest"]["domains"][DOMAIN]
    assert meta["backbone"]["tokens_seen"] == STEPS * 8 * 128 and meta["backbone"]["steps"] == STEPS
    assert meta["backbone"]["final"] == llama_run["backbone"]["final"]
    assert meta["mtp"]["final"] == llama_run["mtp"]["final"]
    assert meta["mtp"]["beats_bigram"] is True
    for name, digest in meta["weights_sha256"].items():
        assert hashlib.sha256((exported / name).read_bytes()).hexdigest() == digest
    # the exported model loads and its drafter matches the trained one up to bf16 rounding
    from transformers import AutoModelForCausalLM

    from specialists.models.mtp import load_drafter

    AutoModelForCausalLM.from_pretrained(str(exported))
    a, b = load_drafter(llama_run["out"] / "backbone"), load_drafter(exported)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(q, p.to(torch.bfloat16).float(), rtol=0, atol=0)


@pytest.mark.slow
def test_export_without_chat_template(llama_run, workspace, tmp_path) -> None:
    tok = tmp_path / "tok"
    shutil.copytree(workspace["tokenizer"], tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "export"
    assert export.cli(["--run", str(llama_run["out"]), "--tokenizer", str(tok), "--packed", str(workspace["packed"]),
                       "--out", str(out), "--dtype", "float32"]) == 0
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    assert not (out / "chat_template.jinja").exists()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}


@pytest.mark.slow
def test_acceptance_on_trained_export(exported, tmp_path, capsys) -> None:
    from bench.acceptance import main

    from specialists.chat import render

    prompts = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "import json\n\n\ndef dumps(obj, *, skipkeys=False", "reference": "):\n    return obj\n"},
        {"prompt": "class Logger(object):\n    def __init__(self, name, level=NOTSET):\n        self.", "reference": "name = name\n"},
        {"prompt": render([{"role": "user", "content": "What is the signature of loads?"}], None, add_generation_prompt=True)},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--model", str(exported), "--prompts", str(prompts), "--k", "3", "--max-new-tokens", "24"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    a = result["acceptance_by_depth"]
    assert len(a) == 3 and a[0] >= a[1] >= a[2]
    assert a[0] > 0.2, result  # a trained drafter agrees with its backbone well above chance
    assert result["next_token_acc"] is not None and result["next_token_acc"] > 0
