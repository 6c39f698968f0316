"""The general specialist's data tools: the drafter's prompts and self-distillation packing, the
bigram baseline at a 49k vocabulary, and the routing classifier's `general` data."""

from __future__ import annotations

import json
import random

import numpy as np

from router.general_data import conversations, documents, read_prompts
from specialists.train.distill import ngrams, pack_examples, row_text
from specialists.train.general_prompts import _clean, held_out
from specialists.train.trainer import bigram_table


def test_bigram_table_matches_the_dense_count():
    rng = np.random.default_rng(0)
    vocab = 60
    stream = rng.integers(0, vocab - 5, 30_000)  # the last 5 ids never occur: they predict 0
    dense = np.zeros((vocab, vocab), dtype=np.int64)
    np.add.at(dense, (stream[:-1], stream[1:]), 1)
    assert (bigram_table(stream, vocab).numpy() == dense.argmax(axis=1)).all()


def test_bigram_table_fits_a_large_vocabulary():
    stream = np.array([40_000, 7, 40_000, 7, 40_000, 9, 49_151, 3], dtype=np.uint16)
    table = bigram_table(stream, 49_152)  # a dense table would be 19 GB
    assert table.shape == (49_152,) and int(table[40_000]) == 7 and int(table[49_151]) == 3 and int(table[5]) == 0


def test_prompt_sources_drop_reserved_evaluation_names():
    rows = [("python3-networkx", "graph library"), ("bash-completion", "programmable completion"),
            ("extra-cmake-modules", "extra CMake modules"), ("libboost-dev", "Boost C++ libraries"),
            ("ripgrep", "recursively searches directories"), ("ripgrep", "a duplicate name"), ("x", "too short")]
    assert [name for name, _ in _clean(rows)] == ["ripgrep"]


def test_held_out_split_is_seeded_and_about_five_percent():
    prompts = [f"question number {i}" for i in range(4000)]
    picked = [held_out(p, 0) for p in prompts]
    assert picked == [held_out(p, 0) for p in prompts] and 0.03 < sum(picked) / len(picked) < 0.07
    assert picked != [held_out(p, 1) for p in prompts]


def test_pack_examples_masks_only_replies():
    chat, mask, starts = pack_examples([([1, 2, 3], [4, 5], True), ([6], [7, 8, 9], False)], eot=0)
    assert chat.tolist() == [1, 2, 3, 4, 5, 0, 6, 7, 8, 9, 0]
    assert mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0] and starts.tolist() == [0, 6]


def test_decontamination_spans():
    evaluation = {"prompt": "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting culture"}
    banned = ngrams(row_text(evaluation))
    assert ngrams("Please compose an engaging travel blog post about a recent trip to Hawaii now") & banned
    assert not ngrams("Write a travel blog post about a trip to Iceland and its hot springs please") & banned
    assert row_text({"messages": [{"role": "user", "content": "a b"}]}) == "a b"


def test_general_classifier_data_layout(tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"request {i}"}) + "\n" for i in range(50)) + json.dumps({"prompt": "request 3"}) + "\n")
    prompts = read_prompts([src])
    assert len(prompts) == 50  # duplicates dropped
    rng = random.Random(0)
    docs = documents(prompts, rng)
    assert sum(d["text"].count("\n") for d in docs) == 50 and all(8 <= d["text"].count("\n") <= 24 for d in docs[:-1])
    convs = conversations(prompts, rng)
    assert [c["messages"][-1]["content"] for c in convs] == prompts
    assert {c["messages"][0]["role"] for c in convs} == {"system", "user"}
