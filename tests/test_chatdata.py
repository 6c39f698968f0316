"""Conversation synthesis, evaluation-set export and bench.chat_eval on fixture documents."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from specialists.chat import TOOL_CALL_OPEN, parse_tool_calls, render, validate_arguments
from specialists.train import chatdata, evalsets
from specialists.train.tokenizer import train_tokenizer
from specialists.train.tools import TOOLS

CPP_DOC = {"path": "usr/include/c++/12/bits/stl_vector.h", "source": "libstdc++", "text": """\
/** @file bits/stl_vector.h
 *  This is an internal header file, included by other library headers.
 *  Do not attempt to use it directly. @headername{vector}
 */
namespace std _GLIBCXX_VISIBILITY(default)
{
  /**
   *  @brief A standard container which offers fixed time access to
   *  individual elements in any order.
   */
  template<typename _Tp, typename _Alloc = std::allocator<_Tp> >
    class vector : protected _Vector_base<_Tp, _Alloc>
    {
    public:
      /**
       *  @brief  Attempt to preallocate enough memory for specified number of
       *          elements.
       *  @param  __n  Number of elements required.
       */
      void
      reserve(size_type __n);

      /**  Returns the number of elements in the %vector.  */
      size_type
      size() const _GLIBCXX_NOEXCEPT
      { return size_type(this->_M_impl._M_finish - this->_M_impl._M_start); }

      /// Returns true if the %vector is empty.
      bool
      empty() const _GLIBCXX_NOEXCEPT
      { return begin() == end(); }
    };
} // namespace std
"""}

CPP_C_DOC = {"path": "usr/include/string.h", "source": "headers", "text": """\
#ifndef _STRING_H
#define _STRING_H 1
/* Return the length of S.  */
extern size_t strlen (const char *__s)
     __THROW __attribute_pure__ __nonnull ((1));

/* Copy SRC to DEST.  */
extern char *strcpy (char *__restrict __dest, const char *__restrict __src)
     __THROW __nonnull ((1, 2));

/* Find the first occurrence of C in S.  */
extern char *strchr (const char *__s, int __c)
     __THROW __attribute_pure__ __nonnull ((1));
#endif
"""}

PY_DOC = {"path": "usr/lib/python3.11/textwrap.py", "source": "stdlib", "text": '''\
"""Text wrapping and filling.
"""

import re

__all__ = ['TextWrapper', 'wrap', 'fill', 'dedent', 'indent', 'shorten']

_whitespace = '\\t\\n\\x0b\\x0c\\r '


class TextWrapper:
    """
    Object for wrapping/filling text.  The public interface consists of
    the wrap() and fill() methods; the other methods are just there for
    subclasses to override in order to tweak the default behaviour.
    """

    def __init__(self, width=70, initial_indent=""):
        self.width = width
        self.initial_indent = initial_indent

    def wrap(self, text):
        """wrap(text : string) -> [string]

        Reformat the single paragraph in 'text' so it fits in lines of no
        more than 'self.width' columns, and return a list of wrapped lines.
        """
        return [text[:self.width]]


def wrap(text, width=70, **kwargs):
    """Wrap a single paragraph of text, returning a list of wrapped lines."""
    w = TextWrapper(width=width, **kwargs)
    return w.wrap(text)


def fill(text, width=70, **kwargs):
    """Fill a single paragraph of text, returning a new string."""
    w = TextWrapper(width=width, **kwargs)
    return "\\n".join(w.wrap(text))


def dedent(text):
    """Remove any common leading whitespace from every line in `text`."""
    return text
'''}

CMAKE_DOC = {"path": "usr/share/cmake-3.25/Modules/FindZLIB.cmake", "source": "cmake-modules", "text": """\
# Distributed under the OSI-approved BSD 3-Clause License.  See accompanying
# file Copyright.txt or https://cmake.org/licensing for details.

#[=======================================================================[.rst:
FindZLIB
--------

Find the native ZLIB includes and library.

IMPORTED Targets
^^^^^^^^^^^^^^^^

This module defines :prop_tgt:`IMPORTED` target ``ZLIB::ZLIB``, if
ZLIB has been found.
#]=======================================================================]

set(_ZLIB_SEARCHES)
find_path(ZLIB_INCLUDE_DIR NAMES zlib.h)
add_library(zlib_helper STATIC zhelper.c zutil.c)
mark_as_advanced(ZLIB_INCLUDE_DIR)
"""}

MAKE_DOC = {"path": "usr/share/doc/demo/Makefile", "source": "makefiles", "text": """\
CC = gcc
OBJS = main.o util.o

# Build the demo program from its objects.
demo: $(OBJS)
\t$(CC) -o demo $(OBJS)

# Remove build products.
clean:
\trm -f demo $(OBJS)

.PHONY: clean
"""}

M4_DOC = {"path": "usr/share/aclocal/ax_check_zlib.m4", "source": "aclocal", "text": """\
# AX_CHECK_ZLIB([action-if-found], [action-if-not-found])
# --------------------------------------------------------
# Check for the zlib compression library and add its flags to CPPFLAGS
# and LDFLAGS when it is found.
AC_DEFUN([AX_CHECK_ZLIB],
[AC_CHECK_LIB([z], [inflateEnd])])
"""}

MAN_DOC = {"path": "man/man1/ls.1", "source": "man1", "text": """\
LS(1)                            User Commands                           LS(1)

NAME
       ls - list directory contents

SYNOPSIS
       ls [OPTION]... [FILE]...

DESCRIPTION
       List  information  about  the FILEs (the current directory by default).
       Sort entries alphabetically if none of -cftuvSUX nor --sort  is  speci-
       fied.

       -a, --all
              do not ignore entries starting with .

       -A, --almost-all
              do not list implied . and ..
"""}

SCRIPT_DOC = {"path": "usr/bin/rotate-logs", "source": "scripts", "text": """\
#!/bin/sh
# Rotate the application log files and compress the old ones.
# Keeps the last seven archives.

set -e
LOGDIR=/var/log/demo
for f in "$LOGDIR"/*.log; do
    mv "$f" "$f.1"
    gzip -9 "$f.1"
done
find "$LOGDIR" -name '*.gz' -mtime +7 -delete
echo "rotated"
"""}

DOCS = {
    "cpp": [CPP_DOC, CPP_C_DOC],
    "python": [PY_DOC],
    "build": [CMAKE_DOC, MAKE_DOC, M4_DOC],
    "shell": [MAN_DOC, SCRIPT_DOC],
}


@pytest.fixture(scope="module")
def conversations() -> dict[str, list[dict]]:
    return {d: chatdata.synthesize(d, docs, 300, seed=0) for d, docs in DOCS.items()}


@pytest.mark.parametrize("domain", list(DOCS))
def test_every_kind(conversations, domain: str) -> None:
    kinds = {c["kind"] for c in conversations[domain]}
    assert kinds == {"continue", "explain", "tool", "notool"}
    assert len(conversations[domain]) == 300
    # every tool of the domain is exercised
    used = {m["tool_calls"][0]["function"]["name"] for c in conversations[domain]
            for m in c["messages"] if m.get("tool_calls")}
    assert used == {t["function"]["name"] for t in TOOLS[domain]}


@pytest.mark.parametrize("domain", list(DOCS))
def test_tool_calls_valid_and_notool_clean(conversations, domain: str) -> None:
    schemas = {t["function"]["name"]: t for t in TOOLS[domain]}
    for conv in conversations[domain]:
        text = render(conv["messages"], conv["tools"])
        assert len(text) <= chatdata.MAX_RENDERED_CHARS
        roles = [m["role"] for m in conv["messages"] if m["role"] != "system"]
        if conv["kind"] == "tool":
            assert roles == ["user", "assistant", "tool", "assistant"]
            call_msg = conv["messages"][-3]
            assert len(call_msg["tool_calls"]) == 1
            fn = call_msg["tool_calls"][0]["function"]
            offered = {t["function"]["name"] for t in conv["tools"]}
            assert fn["name"] in offered
            assert validate_arguments(fn["arguments"], schemas[fn["name"]]) is None
            # the rendered assistant turn parses back to the same call
            turn = render([call_msg]).split("assistant\n", 1)[1]
            _, calls = parse_tool_calls(turn)
            assert calls[0].ok and calls[0].name == fn["name"] and calls[0].arguments == fn["arguments"]
            assert conv["messages"][-2]["content"].strip()
        else:
            assert roles == ["user", "assistant"]
            assert not conv["messages"][-1].get("tool_calls")
            assert TOOL_CALL_OPEN not in text.split("</tools>")[-1].replace(
                "reply with <tool_call>", "")
            if conv["kind"] == "notool":
                assert conv["tools"] is None
    # some continue/explain rows offer tools they do not need
    assert any(c["tools"] for c in conversations[domain] if c["kind"] in ("continue", "explain"))


def test_grounded_in_documents(conversations) -> None:
    texts = {d: "\n".join(render(c["messages"], c["tools"]) for c in convs) for d, convs in conversations.items()}
    assert "std::vector::reserve" in texts["cpp"] and "void reserve(size_type __n);" in texts["cpp"]
    assert "strlen" in texts["cpp"] and "Return the length of S." in texts["cpp"]
    assert "textwrap.wrap" in texts["python"] and "Wrap a single paragraph of text" in texts["python"]
    assert "Find the native ZLIB includes and library." in texts["build"]
    assert "AX_CHECK_ZLIB" in texts["build"] and "zlib_helper" in texts["build"]
    assert "ls - list directory contents" in texts["shell"] or "list directory contents" in texts["shell"]
    assert "Rotate the application log files" in texts["shell"]


def test_run_python_results_are_real(conversations) -> None:
    for conv in conversations["python"]:
        if conv["kind"] != "tool":
            continue
        fn = conv["messages"][-3]["tool_calls"][0]["function"]
        if fn["name"] != "run_python" or "\n" in fn["arguments"]["code"]:
            continue
        value = eval(fn["arguments"]["code"], {"__builtins__": chatdata._SAFE_BUILTINS})  # noqa: S307
        assert conv["messages"][-2]["content"] == repr(value)


def test_deterministic() -> None:
    a = chatdata.synthesize("build", DOCS["build"], 50, seed=3)
    b = chatdata.synthesize("build", DOCS["build"], 50, seed=3)
    c = chatdata.synthesize("build", DOCS["build"], 50, seed=4)
    assert json.dumps(a) == json.dumps(b)
    assert json.dumps(a) != json.dumps(c)


def _write_corpus(root: Path) -> None:
    for domain, docs in DOCS.items():
        for split in ("train", "validation", "test"):
            path = root / domain / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(d) + "\n" for d in sorted(docs, key=lambda d: d["path"])))


def test_cli_and_evalsets(tmp_path: Path) -> None:
    corpora, chat, bench = tmp_path / "corpora", tmp_path / "chat", tmp_path / "bench"
    _write_corpus(corpora)
    assert chatdata.cli(["--corpora", str(corpora), "--out", str(chat), "--per-domain", "60", "--seed", "1"]) == 0
    for domain in DOCS:
        rows = [json.loads(x) for x in (chat / domain / "train.jsonl").read_text().splitlines()]
        assert len(rows) == 60
        assert len((chat / domain / "test.jsonl").read_text().splitlines()) == 3
    first = (chat / "cpp" / "train.jsonl").read_text()
    assert chatdata.cli(["--corpora", str(corpora), "--out", str(chat), "--per-domain", "60", "--seed", "1"]) == 0
    assert (chat / "cpp" / "train.jsonl").read_text() == first

    assert chatdata.cli(["--corpora", str(corpora), "--out", str(chat), "--per-domain", "400", "--seed", "1"]) == 0
    assert evalsets.cli(["--corpora", str(corpora), "--chat", str(chat), "--out", str(bench), "--n", "20"]) == 0
    for domain in DOCS:
        prompts = [json.loads(x) for x in (bench / domain / "prompts.jsonl").read_text().splitlines()]
        assert prompts, domain
        for p in prompts:
            assert p["prompt"].endswith("\n") and 200 <= len(p["prompt"]) <= 601
            assert p["reference"]
        tool_rows = [json.loads(x) for x in (bench / domain / "tool_convs.jsonl").read_text().splitlines()]
        assert tool_rows
        for row in tool_rows:
            assert row["messages"][-1]["role"] == "user"
            schemas = {t["function"]["name"]: t for t in row["tools"]}
            assert validate_arguments(row["expected"]["arguments"], schemas[row["expected"]["name"]]) is None
        chat_rows = [json.loads(x) for x in (bench / domain / "chat_prompts.jsonl").read_text().splitlines()]
        assert any(r["tools"] is None for r in chat_rows)
        assert all(r["messages"][-1]["role"] == "user" for r in chat_rows)


def test_cut_prompt_line_boundary() -> None:
    text = "".join(f"line {i} of the document with some words\n" for i in range(200))
    prompt, reference = evalsets.cut_prompt(text, random.Random(0))
    assert prompt.endswith("\n") and text.find(prompt + reference) >= 0


# ---------------------------------------------------------------------------------------------- chat_eval


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, conversations) -> tuple[Path, Path]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path_factory.mktemp("model")
    texts = [render(c["messages"], c["tools"]) for c in conversations["shell"]]
    train_tokenizer(texts + [d["text"] for d in DOCS["shell"]], 400, model_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=None, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    (model_dir / "cantata.json").write_text(json.dumps({"domain": "shell"}))

    data = tmp_path_factory.mktemp("data")
    chat_dir = tmp_path_factory.mktemp("chat")
    (chat_dir / "shell").mkdir()
    (chat_dir / "shell" / "test.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations["shell"]))
    for name, rows in (("tool_convs", evalsets.tool_conversations(chat_dir, "shell", 4)),
                       ("chat_prompts", evalsets.chat_prompts(chat_dir, "shell", 8))):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, data


def test_chat_eval_metrics(tiny_model, capsys: pytest.CaptureFixture) -> None:
    from bench import chat_eval

    model_dir, data = tiny_model
    assert chat_eval.main(["--model", str(model_dir), "--data", str(data), "--max-new-tokens", "6",
                           "--batch-size", "3"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == {"model", "domain", "tool_convs", "tool_call_valid", "tool_name_match",
                           "no_tools_prompts", "no_tools_call_rate", "chat_prompts", "end_of_turn_rate",
                           "end_of_turn_by_kind"}
    kinds = result["end_of_turn_by_kind"]
    assert kinds and all(0.0 <= v <= 1.0 for v in kinds.values())
    assert result["domain"] == "shell" and result["tool_convs"] == 4 and result["chat_prompts"] == 8
    assert result["no_tools_prompts"] >= 1
    for key in ("tool_call_valid", "tool_name_match", "no_tools_call_rate", "end_of_turn_rate"):
        assert isinstance(result[key], float) and 0.0 <= result[key] <= 1.0


def test_chat_eval_scoring() -> None:
    from bench.chat_eval import score_tool_call

    tools = TOOLS["shell"]
    good = '<tool_call>{"name": "run_shell", "arguments": {"command": "ls"}}</tool_call><|im_end|>'
    assert score_tool_call(good, tools, {"name": "run_shell"}) == (True, True)
    assert score_tool_call(good, tools, {"name": "man_page"}) == (True, False)
    bad_args = '<tool_call>{"name": "man_page", "arguments": {"section": 1}}</tool_call>'
    assert score_tool_call(bad_args, tools, {"name": "man_page"}) == (False, True)
    assert score_tool_call("no call", tools, {"name": "man_page"}) == (False, False)


def test_chat_eval_refuses_without_weights(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from bench import chat_eval

    assert chat_eval.main(["--model", str(tmp_path)]) == 2
    assert "model.safetensors" in capsys.readouterr().err
