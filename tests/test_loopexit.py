"""Loop-exit data (specialists/train/loopexit.py): where looping replies are cut, what carries loss, and
that the packed stream it builds is deterministic and keeps the base conversations."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from specialists.train import loopexit
from specialists.train.__main__ import main as train_main
from specialists.train.data import TokenStreams
from specialists.train.pack import pack_chat
from specialists.train.tokenizer import load_tokenizer

MODEL_DIR = Path(__file__).resolve().parents[1] / "deploy" / "models" / "cpp"  # data/ is not in git
CODE = "```cpp\n  int first_value = 1;\n  int second_value = 2;\n"
PROMPT = [{"role": "user", "content": "Continue this code:\n```cpp\nint main()\n```"}]


@pytest.fixture(scope="module")
def tok():  # noqa: ANN201
    return load_tokenizer(MODEL_DIR)


def loss_text(tok, example) -> str:  # noqa: ANN001
    ids, mask = example
    return tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)


def one_id(tok, piece: str) -> int:  # noqa: ANN001
    ids = tok(piece, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, (piece, ids)
    return ids[0]


# ---- cut finders ------------------------------------------------------------------------------


def test_line_cuts_at_first_repeated_line_and_two_after() -> None:
    text = CODE + "  int third_value = 3;\n  int first_value = 1;\n  a;\n  b;\n  c;\n"
    lines = text.split("\n")
    after = [len("\n".join(lines[: i + 1])) + 1 for i in range(len(lines) - 1)]  # offset after line i
    assert loopexit.first_repeated_line(lines) == 4
    assert loopexit.line_cuts(text, "explain") == after[4:7]
    assert text[: after[4]].endswith("  int third_value = 3;\n  int first_value = 1;\n")


def test_line_cuts_ignore_short_lines_and_fences() -> None:
    text = "```cpp\n}\n}\n```\nx;\nx;\n```\n"
    assert loopexit.first_repeated_line(text.split("\n")) is None
    assert loopexit.line_cuts(text, "explain") == []
    assert loopexit.first_repeated_line((text + "```cpp\n").split("\n")) == 7  # an opening "```cpp" line counts


def test_line_cuts_of_a_long_continue_reply_after_four_lines() -> None:
    text = "```cpp\n" + "".join(f"  int value_{i} = {i};\n" for i in range(8))
    cut = loopexit.line_cuts(text, "continue")
    assert cut == [len("```cpp\n" + "".join(f"  int value_{i} = {i};\n" for i in range(4)))]
    assert loopexit.line_cuts(text, "explain") == []  # only continue replies are cut without a repeat


def test_token_loop_cut_finds_the_first_repeated_span(tok) -> None:  # noqa: ANN001
    a, b, c, d = (one_id(tok, s) for s in ("int", " main", "(", ")"))
    x, y = one_id(tok, " value"), one_id(tok, " =")
    assert loopexit.token_loop_cut(tok, [a, b, c, d] + [x] * 9) == (4 + 6, 1)  # period 1: six repeats
    assert loopexit.token_loop_cut(tok, [a, b, c] + [x, y] * 5) == (3 + 6, 2)  # period 2: three repeats
    assert loopexit.token_loop_cut(tok, [a, b, c] + [x, y] * 2 + [d]) is None  # too few repeats
    semi = one_id(tok, ";")
    assert loopexit.token_loop_cut(tok, [a, b] + [semi] * 12) is None  # punctuation-only loops do not count


def test_reply_cuts_prefer_an_earlier_token_loop(tok) -> None:  # noqa: ANN001
    loop = "x = x = x = x = x = x = x = x = x = x = x = x"
    text = "```cpp\n  " + loop + "\n  int first_value = 1;\n  int first_value = 1;\n"
    cuts = loopexit.reply_cuts(tok, text, "explain")
    line_cuts = loopexit.line_cuts(text, "explain")
    token_cuts = [c for c in cuts if c not in line_cuts]
    assert line_cuts and set(line_cuts) <= set(cuts)
    assert 1 <= len(token_cuts) <= 3 and max(token_cuts) < min(line_cuts)
    assert all(text[:c].startswith("```cpp\n  x = x") for c in token_cuts)


# ---- exit examples ----------------------------------------------------------------------------


def test_exit_example_closes_an_open_fence(tok) -> None:  # noqa: ANN001
    example = loopexit.exit_example(tok, PROMPT, None, CODE + "  int first_value = 1;\n")
    assert example is not None
    ids, mask = example
    assert loss_text(tok, example) == "```<|im_end|>"
    last = max(i for i, m in enumerate(mask) if m)
    assert ids[last] == tok.convert_tokens_to_ids("<|im_end|>") and last == len(ids) - 2  # then the "\n"
    assert all(m == 0 for m in mask[: last - 1 - 2])  # the looping prefix carries no loss


def test_exit_example_without_an_open_fence_only_ends_the_turn(tok) -> None:  # noqa: ANN001
    closed = "The value is set twice. The value is set twice."
    assert loss_text(tok, loopexit.exit_example(tok, PROMPT, None, closed)) == "<|im_end|>"
    no_newline = CODE + "  int first_value"
    assert loopexit.turn_close(no_newline) == "\n```"
    assert loss_text(tok, loopexit.exit_example(tok, PROMPT, None, no_newline)).endswith("```<|im_end|>")


def test_synthetic_prefix_repeats_a_line_of_the_answer() -> None:
    answer = CODE + "```"
    prefix = loopexit.repeated_line_prefix(answer, random.Random(3))
    assert prefix is not None and loopexit.fence_open(prefix)
    lines = prefix.split("\n")[:-1]
    assert lines[-1] == lines[-2] and lines[-1].strip() in ("int first_value = 1;", "int second_value = 2;")
    assert loopexit.repeated_line_prefix("```cpp\n}\n```", random.Random(3)) is None


# ---- build ------------------------------------------------------------------------------------


def continue_row(i: int) -> dict:
    body = "".join(f"  int value_{i}_{j} = {j};\n" for j in range(3))
    return {"kind": "continue", "tools": None, "messages": [
        {"role": "user", "content": f"Continue this code:\n```cpp\nint f{i}()\n```"},
        {"role": "assistant", "content": "```cpp\n" + body + "```"}]}


@pytest.fixture(scope="module")
def inputs(tok, tmp_path_factory) -> dict:  # noqa: ANN001
    root = tmp_path_factory.mktemp("loopexit")
    base_rows = [continue_row(i) for i in range(12)]
    eot = tok.convert_tokens_to_ids(loopexit.EOT_TOKEN)
    for split in ("train", "validation"):
        chat, mask, starts = pack_chat(tok, base_rows, 10**9, eot)
        folder = root / "packed" / "cpp" / split
        folder.mkdir(parents=True)
        for name, arr in (("text", np.arange(100, 140, dtype=np.uint16)), ("chat", chat), ("chat_mask", mask),
                          ("chat_starts", starts)):
            np.save(folder / f"{name}.npy", arr)
    (root / "packed" / "manifest.json").write_text(json.dumps({"domains": {"cpp": {"validation": {"conversations": 12}}}}))
    looping = CODE + "  int first_value = 1;\n  int first_value = 1;\n  int first_value = 1;\n"
    replies = [{**r, "messages": r["messages"][:1], "reply": text, "ended": ended}
               for r, text, ended in ((continue_row(90), looping, False), (continue_row(91), CODE + "```<|im_end|>", True))]
    (root / "replies.jsonl").write_text("".join(json.dumps(r) + "\n" for r in replies))
    (root / "chat.jsonl").write_text("".join(json.dumps(continue_row(100 + i)) + "\n" for i in range(20)))
    return {"root": root, "base": TokenStreams.load(root / "packed" / "cpp" / "train")}


def build_cli(root: Path, out: str, seed: int) -> dict:
    assert train_main(["loop-exit", "build", "--replies", str(root / "replies.jsonl"), "--chat", str(root / "chat.jsonl"),
                       "--tokenizer", str(MODEL_DIR), "--packed", str(root / "packed"), "--out", str(root / out),
                       "--synthetic", "5", "--onpolicy-repeats", "2", "--seed", str(seed)]) == 0
    return json.loads((root / out / "manifest.json").read_text())["domains"]["cpp"]["train"]


def conversations(streams: TokenStreams) -> list[bytes]:
    return [c.tobytes() + m.tobytes() for c, m in loopexit.split_conversations(streams)]


def test_build_adds_exits_to_the_base_stream(inputs) -> None:  # noqa: ANN001
    root, base = inputs["root"], inputs["base"]
    train = build_cli(root, "a", seed=1234)
    assert train["loop_exit_onpolicy"] == 3  # after the first repeat and the two lines after it
    assert 1 <= train["loop_exit_synthetic"] <= 5
    assert train["loop_exit_conversations"] == 2 * train["loop_exit_onpolicy"] + train["loop_exit_synthetic"]
    assert train["conversations"] == 12 + train["loop_exit_conversations"]
    new = TokenStreams.load(root / "a" / "cpp" / "train")
    assert np.array_equal(new.text, base.text) and train["text_tokens"] == len(base.text)
    kept, before = conversations(new), set(conversations(base))
    assert before <= set(kept)  # base conversations unchanged, only reordered
    exit_masks = [m for c, m in loopexit.split_conversations(new) if c.tobytes() + m.tobytes() not in before]
    assert len(exit_masks) == train["loop_exit_conversations"]
    assert all(1 <= int(m.sum()) <= 4 for m in exit_masks)  # loss only on the turn's close
    assert (root / "a" / "cpp" / "validation" / "chat.npy").read_bytes() == (root / "packed" / "cpp" / "validation" / "chat.npy").read_bytes()


def test_build_is_deterministic_for_a_seed(inputs) -> None:  # noqa: ANN001
    root = inputs["root"]
    first, again, other = build_cli(root, "s1", 7), build_cli(root, "s1b", 7), build_cli(root, "s2", 8)
    assert first == again and first["sha256"] == again["sha256"]
    for name in ("chat", "chat_mask", "chat_starts"):
        assert (root / "s1" / "cpp" / "train" / f"{name}.npy").read_bytes() == (root / "s1b" / "cpp" / "train" / f"{name}.npy").read_bytes()
    assert other["sha256"] != first["sha256"]


def test_build_reports_missing_inputs(inputs, capsys) -> None:  # noqa: ANN001
    root = inputs["root"]
    with pytest.raises(SystemExit) as err:
        train_main(["loop-exit", "build", "--replies", str(root / "nope.jsonl"), "--chat", str(root / "chat.jsonl"),
                    "--tokenizer", str(MODEL_DIR), "--packed", str(root / "packed"), "--out", str(root / "x")])
    assert err.value.code == 2 and "nope.jsonl does not exist" in capsys.readouterr().err


def test_select_prompts_takes_kinds_and_sorts_by_prompt_length() -> None:
    rows = [continue_row(i) for i in range(5)] + [{**continue_row(50 + i), "kind": k} for i, k in enumerate(("explain", "notool", "tool"))]
    rows[2]["messages"][0]["content"] += " and some more words"
    chosen = loopexit.select_prompts(rows, 3, 5, seed=0)
    assert sum(r["kind"] == "continue" for r in chosen) == 3 and {r["kind"] for r in chosen} == {"continue", "explain", "notool"}
    assert [len(r["prompt"]) for r in chosen] == sorted(len(r["prompt"]) for r in chosen)
    assert all(r["prompt"].endswith("<|im_start|>assistant\n") and r["prompt_messages"] == r["messages"][:1] for r in chosen)
    assert loopexit.select_prompts(rows, 3, 5, seed=0) == chosen
