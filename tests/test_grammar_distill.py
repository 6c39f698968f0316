"""The drafter's grammar self-distillation data (specialists/train/grammar_distill.py): schemas made from
the standard library's signatures, requests rendered as the server renders them, the checkpoint's own
replies under the grammar, and streams whose loss falls on the replies only."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import jsonschema
import numpy as np

from specialists.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from specialists.train import grammar_distill as gd

CHAT = [{"messages": [{"role": "user", "content": "Explain std::cref."}]},
        {"messages": [{"role": "system", "content": "You help with C++."}, {"role": "user", "content": "What is std::move?"}]}]


def test_function_schemas_are_plain_objects_with_their_parameters() -> None:
    fns = gd.function_schemas()
    assert len(fns) > 200 and len({f["name"] for f in fns}) == len(fns)
    by_name = {f["name"]: f for f in fns}
    gauss = by_name["random_gauss"]["parameters"]  # gauss(mu=0.0, sigma=1.0)
    assert gauss["properties"] == {"mu": {"type": "number"}, "sigma": {"type": "number"}} and gauss["required"] == []
    for f in fns:
        jsonschema.Draft202012Validator.check_schema(f["parameters"])
        assert set(f["parameters"]["required"]) <= set(f["parameters"]["properties"])
    kinds = {p["type"] for f in fns for p in f["parameters"]["properties"].values()}
    assert kinds == {"string", "integer", "number", "boolean", "array"}


def test_requests_alternate_response_format_and_a_required_tool_call() -> None:
    fns = gd.function_schemas()[:20]
    reqs = gd.requests(CHAT, fns, 6, seed=1)
    assert [s.kind for _, s in reqs] == ["json_schema", "tool_call"] * 3
    for prompt, spec in reqs:
        assert prompt.rstrip().endswith(TOOL_CALL_OPEN) == (spec.kind == "tool_call")
        if spec.kind == "tool_call":  # the offered tools are in the system turn
            assert all(t.name in prompt for t in spec.tools)
    assert gd.requests(CHAT, fns, 6, seed=1) == reqs  # seeded


def test_replies_follow_their_grammar_and_the_streams_carry_loss_on_replies_only(tmp_path: Path) -> None:
    args = Namespace(model="deploy/models/cpp", chat=tmp_path / "chat.jsonl", corpus=None, out=tmp_path / "out",
                     domain="cpp", constrained=6, free=2, max_tokens=128, batch=4, seed=3, text_tokens=0)
    args.chat.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    summary = gd.run(args)
    assert summary["constrained"] == 6 and summary["free"] == 2
    train = args.out / "cpp" / "train"
    chat, mask, starts = (np.load(train / f"{n}.npy") for n in ("chat", "chat_mask", "chat_starts"))
    assert len(starts) == 8 and int(mask.sum()) == summary["train"]["reply_tokens"]
    assert summary["train"]["reply_tokens"] == summary["reply_tokens"]["constrained"] + summary["reply_tokens"]["free"]
    rows = [json.loads(line) for line in (args.out / "replies.jsonl").read_text().splitlines()]
    constrained = [r for r in rows if r["kind"] == "constrained"]
    assert [r["grammar"] for r in constrained] == ["json_schema", "tool_call"] * 3
    finished = [r for r in constrained if r["reply"].endswith(("<|im_end|>", TOOL_CALL_CLOSE))]
    assert len(finished) >= 4
    for r in finished:  # complete JSON: valid for its schema, or a call to an offered tool
        text = r["reply"].replace("<|im_end|>", "")
        if r["grammar"] == "tool_call":
            call = json.loads(text.split(TOOL_CALL_CLOSE)[0])
            assert call["name"] in r["offered"] and isinstance(call["arguments"], dict)
        else:
            jsonschema.validate(json.loads(text), r["schema"])


def test_export_drafter_into_a_shipped_model_replaces_only_its_drafter(tmp_path: Path) -> None:
    """`export-drafter --into`: the retrained drafter replaces a model directory's own, stored in the
    dtype the old one was, with cantata.json's backbone record kept, the old drafter's record under
    mtp_before and the new weights' sha256; the backbone's weights are untouched."""
    import hashlib
    import shutil

    import torch
    from safetensors import safe_open

    from specialists.models.mtp import load_drafter, save_drafter
    from specialists.train.drafter_export import cli

    model = tmp_path / "cpp"
    shutil.copytree("deploy/models/cpp", model)
    before = json.loads((model / "cantata.json").read_text())
    drafter = load_drafter(model)
    with torch.no_grad():
        drafter.proj.weight.add_(0.01)
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    save_drafter(drafter, ckpt)  # float32, as training leaves it
    run.mkdir()
    (run / "mtp_result.json").write_text(json.dumps({"steps": 7, "final": {"val_a1_tf": 0.5}, "lr": 1e-4}))
    assert cli(["--checkpoint", str(ckpt), "--run", str(run), "--distill", str(tmp_path), "--into", str(model),
                "--version", "v9", "--note", "a test"]) == 0
    after = json.loads((model / "cantata.json").read_text())
    assert after["backbone"] == before["backbone"] and after["mtp_before"] == before["mtp"]
    assert after["mtp"] == {"steps": 7, "final": {"val_a1_tf": 0.5}, "lr": 1e-4} and after["version"] == "v9"
    for name in ("model.safetensors", "mtp.safetensors"):
        assert after["weights_sha256"][name] == hashlib.sha256((model / name).read_bytes()).hexdigest()
    assert after["weights_sha256"]["model.safetensors"] == before["weights_sha256"]["model.safetensors"]
    with safe_open(str(model / "mtp.safetensors"), "pt") as f:
        assert f.get_slice("proj.weight").get_dtype() == "BF16"
    shipped = load_drafter(model).proj.weight
    assert torch.equal(shipped, drafter.proj.weight.to(torch.bfloat16).float())


def test_drafter_loss_on_replies_only_counts_the_reply_tokens_predicted() -> None:
    """`mtp --loss-on replies`: the soft cross-entropy of a depth at position t (its draft is token
    t+2 of the input) counts only when that token carries loss; with loss everywhere it is the default."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from specialists.models.mtp import depth_weights, load_drafter
    from specialists.train.data import Batch
    from specialists.train.trainer import drafter_losses

    backbone = AutoModelForCausalLM.from_pretrained("deploy/models/cpp", dtype=torch.float32).eval()
    drafter = load_drafter(Path("deploy/models/cpp"))
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, backbone.config.vocab_size, (2, 65), generator=g)
    inputs, labels = seq[:, :-1], seq[:, 1:]
    everywhere = Batch(inputs, labels, torch.ones(2, 64))
    with torch.no_grad():
        full, _ = drafter_losses(drafter, backbone, everywhere, 3)
        same, _ = drafter_losses(drafter, backbone, everywhere, 3, replies_only=True)
        reply_from = 44  # input tokens 44.. are the reply's (labels index j - 1 carries input token j)
        mask = (torch.arange(64) + 1 >= reply_from).float().expand(2, 64).contiguous()
        got, _ = drafter_losses(drafter, backbone, Batch(inputs, labels, mask), 3, replies_only=True)
        hidden = backbone.model(input_ids=inputs, use_cache=False).last_hidden_state
        target = backbone.lm_head(hidden)[:, 1:].float().softmax(-1)
        outs = drafter.forward_chains(hidden, inputs, backbone.get_input_embeddings().weight, 3)
        want = torch.zeros(())
        for depth, (out, w) in enumerate(zip(outs, depth_weights(drafter.cfg, 3)), start=1):
            logp = F.log_softmax(drafter.logits(out, backbone.get_output_embeddings().weight).float(), -1)
            ce = -(target * logp).sum(-1)  # [2, 63]: position t drafts input token t + 2
            keep = torch.zeros_like(ce)
            keep[:, depth - 1:] = 1.0
            keep[:, : max(0, reply_from - 2)] = 0.0
            want = want + w * (ce * keep).sum() / keep.sum()
    assert torch.equal(full, same)
    assert torch.allclose(got, want, rtol=1e-5) and not torch.allclose(got, full, rtol=1e-3)


def test_drafter_anchor_acts_on_raw_text_rows_only() -> None:
    """`mtp --anchor-weight W`: W x KL(anchor drafter || drafter) joins the loss on raw-text rows (no
    masked position); it is zero against itself and never touches a chat row."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from specialists.models.mtp import load_drafter
    from specialists.train.data import Batch
    from specialists.train.trainer import drafter_losses

    backbone = AutoModelForCausalLM.from_pretrained("deploy/models/cpp", dtype=torch.float32).eval()
    drafter = load_drafter(Path("deploy/models/cpp"))
    other = copy.deepcopy(drafter)
    with torch.no_grad():
        other.proj.weight.mul_(1.5)
    seq = torch.randint(0, backbone.config.vocab_size, (2, 49), generator=torch.Generator().manual_seed(1))
    text = Batch(seq[:, :-1], seq[:, 1:], torch.ones(2, 48))
    chat_mask = torch.ones(2, 48)
    chat_mask[:, :10] = 0  # a prompt: these rows are chat rows
    chat = Batch(seq[:, :-1], seq[:, 1:], chat_mask)
    with torch.no_grad():
        for batch in (text, chat):
            base, _ = drafter_losses(drafter, backbone, batch, 3)
            assert torch.equal(drafter_losses(drafter, backbone, batch, 3, anchor=(drafter, 1.0))[0], base)
        assert drafter_losses(drafter, backbone, text, 3, anchor=(other, 1.0))[0] > drafter_losses(drafter, backbone, text, 3)[0] + 1e-3
        assert torch.equal(drafter_losses(drafter, backbone, chat, 3, anchor=(other, 1.0))[0], drafter_losses(drafter, backbone, chat, 3)[0])
