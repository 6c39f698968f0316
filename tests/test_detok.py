"""specialists/detok.py: a sequence's text decoded incrementally equals the full decode at every step.

* for the toys' byte-level tokenizer (the incremental path), over random token streams that mix
  multi-byte characters (whose bytes span tokens), special tokens and plain text, step by step with
  runs of 1..5 tokens, with look-aheads that do not advance, and after the ids change under it;
* a tokenizer whose decoding is not a concatenation (clean-up of tokenization spaces) takes the full
  decode.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from transformers import PreTrainedTokenizerFast

from specialists import detok

SHELL = "deploy/models/shell"


@pytest.fixture(scope="module")
def tok():
    return PreTrainedTokenizerFast.from_pretrained(SHELL)


def _stream(tok, rng: random.Random, n: int) -> list[int]:
    pieces = ["héllo wörld ", "日本語のテキスト", "emoji 🎉🚀 ", "ls -la | grep x\n", "\t{\"a\": [1, 2]}\n", "ñandú "]
    text = "".join(rng.choice(pieces) for _ in range(n))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    specials = [i for i in (tok.eos_token_id, tok.pad_token_id) if i is not None]
    for _ in range(max(1, len(ids) // 40)):
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
    return ids


def test_incremental_text_equals_the_full_decode_at_every_step(tok) -> None:
    assert detok.concatenates(tok)
    rng = random.Random(0)
    for trial in range(20):
        ids = _stream(tok, rng, 30)
        seq = SimpleNamespace(detok=(0, "", None))
        i = 0
        while i < len(ids):
            i += rng.randint(1, 5)
            cur = ids[:i]
            peek = cur + ids[i:i + 3]
            assert detok.text_of(tok, seq, peek, advance=False) == tok.decode(peek)
            assert detok.text_of(tok, seq, cur) == tok.decode(cur), (trial, i)
        assert seq.detok[0] > 0  # the stable prefix moved: the incremental path ran
    seq = SimpleNamespace(detok=(0, "", None))
    detok.text_of(tok, seq, ids)
    other = ids[:10] + [ids[11] + 1] + ids[11:40]  # not an extension of what it saw: starts over
    assert detok.text_of(tok, seq, other) == tok.decode(other)
    assert detok.text_of(tok, seq, ids[:5]) == tok.decode(ids[:5])


def test_a_tokenizer_that_cleans_up_spaces_takes_the_full_decode() -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(SHELL, clean_up_tokenization_spaces=True)
    assert not detok.concatenates(tok)
    ids = tok("a , b . c ! d", add_special_tokens=False)["input_ids"] * 10
    seq = SimpleNamespace(detok=(0, "", None))
    for i in range(1, len(ids)):
        assert detok.text_of(tok, seq, ids[:i]) == tok.decode(ids[:i])
    assert seq.detok == (0, "", None)
