"""The chat template, tool-call parsing and the tokenizer built around them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specialists.chat import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    format_tool_call,
    parse_tool_calls,
    render,
    validate_arguments,
)
from specialists.train.tokenizer import encode_conversation, load_tokenizer, train_tokenizer
from specialists.train.tools import TOOLS, tools_for

FIXTURE_TEXT = [
    "#include <vector>\nint main() {\n  std::vector<int> v;\n  v.reserve(10);\n  return 0;\n}\n",
    "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n    return a + b\n\nprint(add(1, 2))\n",
    "cmake_minimum_required(VERSION 3.20)\nproject(demo C)\nadd_executable(demo main.c)\n",
    "all: demo\n\ndemo: main.o\n\t$(CC) -o $@ $^\n\nclean:\n\trm -f demo *.o\n",
    "#!/bin/sh\n# Print the files.\nfor f in *; do\n  echo \"$f\"\ndone\n",
    "LS(1)   User Commands   LS(1)\n\nNAME\n       ls - list directory contents\n\nSYNOPSIS\n       ls [OPTION]... [FILE]...\n",
]

TOOLS_SHELL = tools_for("shell")


def _conversation(arguments_as_string: bool = False) -> list[dict]:
    args: dict | str = {"command": "ls -l", "timeout_s": 5}
    if arguments_as_string:
        args = json.dumps(args)
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "List the files, please."},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "run_shell", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "total 0\n-rw-r--r-- 1 a b 0 x"},
        {"role": "assistant", "content": "There is one file, `x`."},
        {"role": "user", "content": "Thanks! And ünïcode ✓?"},
    ]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    texts = FIXTURE_TEXT * 20 + [render(_conversation(), TOOLS_SHELL)] * 5
    train_tokenizer(texts, 512, out)
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):
    return load_tokenizer(tokenizer_dir)


def test_special_token_ids(tokenizer) -> None:
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.convert_tokens_to_ids(token) == i
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_tokenizer_config_files(tokenizer_dir: Path) -> None:
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["model_max_length"] == 2048 and config["add_bos_token"] is False
    assert (tokenizer_dir / "special_tokens_map.json").exists()


@pytest.mark.parametrize("text", [
    "plain ascii text",
    "  leading and trailing spaces  \n\n\t tabs\r\n",
    "ünïcode ✓ 日本語 emoji 🎉 and \x00 control",
    "<|im_start|>user\nhi<|im_end|>\n<tool_call>{\"name\": \"x\"}</tool_call><|endoftext|>",
    "<tools></tools><tool_response> x </tool_response>",
    "",
])
def test_decode_encode_round_trip(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids(tokenizer) -> None:
    ids = tokenizer("a<|im_end|>b", add_special_tokens=False)["input_ids"]
    assert 2 in ids


@pytest.mark.parametrize("tools", [None, TOOLS_SHELL, [t["function"] for t in TOOLS_SHELL]])
@pytest.mark.parametrize("generation", [False, True])
@pytest.mark.parametrize("as_string", [False, True])
def test_render_matches_transformers(tokenizer, tools, generation: bool, as_string: bool) -> None:
    messages = _conversation(as_string)
    ours = render(messages, tools, add_generation_prompt=generation)
    theirs = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation)
    assert ours == theirs


def test_render_layout() -> None:
    text = render(_conversation(), TOOLS_SHELL, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call these tools:\n<tools>\n")
    assert text.count("<|im_start|>system") == 1
    for tool in TOOLS_SHELL:
        assert json.dumps(tool["function"], ensure_ascii=False) + "\n" in text
    assert '<|im_start|>assistant\n<tool_call>{"name": "run_shell", "arguments": {"command": "ls -l", "timeout_s": 5}}</tool_call><|im_end|>\n' in text
    assert "<|im_start|>tool\n<tool_response>total 0\n-rw-r--r-- 1 a b 0 x</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>user\nThanks! And ünïcode ✓?<|im_end|>\n<|im_start|>assistant\n")
    plain = render([{"role": "user", "content": "hi"}])
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"


def test_render_arguments_string_verbatim() -> None:
    raw = '{"command":  "ls"}'
    msgs = [{"role": "assistant", "content": "Sure.",
             "tool_calls": [{"type": "function", "function": {"name": "run_shell", "arguments": raw}},
                            {"type": "function", "function": {"name": "man_page", "arguments": {"name": "ls"}}}]}]
    text = render(msgs)
    assert text == ("<|im_start|>assistant\nSure.\n" + format_tool_call("run_shell", raw) + "\n"
                    + format_tool_call("man_page", {"name": "ls"}) + "<|im_end|>\n")


def test_parse_good_calls() -> None:
    text = 'Let me check.\n<tool_call>{"name": "run_shell", "arguments": {"command": "ls"}}</tool_call><|im_end|>junk'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert len(calls) == 1 and calls[0].ok
    assert calls[0].name == "run_shell" and calls[0].arguments == {"command": "ls"}
    content, calls = parse_tool_calls("just text<|im_end|>")
    assert content == "just text" and calls == []
    _, calls = parse_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
                                '<tool_call>{"name": "b"}</tool_call>')
    assert [c.arguments for c in calls] == [{"x": 1}, {}]


@pytest.mark.parametrize("text, error", [
    ("<tool_call>{not json}</tool_call>", "invalid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "missing name"),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', "missing name"),
    ('<tool_call>{"name": "x", "arguments": [1]}</tool_call>', "arguments not an object"),
    ('<tool_call>{"name": "x", "arguments": "nope"}</tool_call>', "arguments not an object"),
    ('<tool_call>[1, 2]</tool_call>', "not a JSON object"),
    ('<tool_call>{"name": "x", "arguments": {"a": 1', "unterminated tool call"),
    ('<tool_call>{"name": "x"}<tool_call>{"name": "y"}</tool_call>', "unterminated tool call"),
])
def test_parse_broken_calls(text: str, error: str) -> None:
    _, calls = parse_tool_calls(text)
    assert calls and error in (calls[0].error or "")


@pytest.mark.parametrize("garbage", [
    "", "<tool_call>", "</tool_call>", "<tool_call></tool_call>", "<tool_call>" * 5, "\x00\xff{{{",
    "<tool_call>" + "[" * 5000 + "</tool_call>", None, 12,
])
def test_parse_never_raises(garbage) -> None:
    content, calls = parse_tool_calls(garbage)
    assert isinstance(content, str) and isinstance(calls, list)


def test_validate_arguments() -> None:
    for domain, tools in TOOLS.items():
        assert 2 <= len(tools) <= 3, domain
        for tool in tools:
            assert tool["type"] == "function" and tool["function"]["parameters"]["required"]
    lookup = next(t for t in TOOLS["cpp"] if t["function"]["name"] == "compile_snippet")
    assert validate_arguments({"code": "int main(){}", "std": "c++17"}, lookup) is None
    assert validate_arguments({"code": "int main(){}", "std": "c++17"}, lookup["function"]) is None
    assert validate_arguments({"code": "x", "std": "c++17"}, lookup["function"]["parameters"]) is None
    assert "std" in validate_arguments({"code": "x", "std": "c++99"}, lookup)
    assert "required" in validate_arguments({"std": "c++17"}, lookup)
    assert validate_arguments(None, lookup) is not None
    make = next(t for t in TOOLS["build"] if t["function"]["name"] == "make_target")
    assert validate_arguments({"target": "all", "jobs": "4"}, make) is not None
    assert validate_arguments({"target": "all", "extra": 1}, make) is not None


def test_encode_conversation_mask(tokenizer) -> None:
    messages = _conversation()[:5]
    ids, mask = encode_conversation(tokenizer, messages, TOOLS_SHELL)
    text = render(messages, TOOLS_SHELL)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(mask) == len(ids) and set(mask) <= {0, 1}
    masked = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    expected = ('<tool_call>{"name": "run_shell", "arguments": {"command": "ls -l", "timeout_s": 5}}</tool_call>'
                "<|im_end|>" "There is one file, `x`.<|im_end|>")
    assert masked == expected
    # the mask is contiguous per assistant turn and excludes headers and the newline after <|im_end|>
    runs = sum(1 for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1]))
    assert runs == 2
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    run_ends = [k - 1 for k in range(1, len(mask)) if mask[k - 1] and not mask[k]]
    assert len(run_ends) == 2 and all(ids[k] == end for k in run_ends)
