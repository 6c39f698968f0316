"""Bounded strings as chains of rules (specialists/grammar.unroll_bounded_strings).

xgrammar prints a string with minLength / maxLength (the checkpoint's `max_string` bound adds one to
every free string) as a counted repetition, whose mask fills grow slow late in the string. The engine
compiles the same language as a chain of rules instead. These tests check that it is the same
language: the masks of both forms are equal token by token along walks through a schema of our own,
strings written to their bound included, and the counted form is kept where the chain would be long.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from specialists.grammar import SEPARATORS, UNROLL_MAX, Bounds, GrammarCompiler, _unrolled, bounded, unroll_bounded_strings

BOUNDS = Bounds(max_string=16, max_items=3, number_range=1e6)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"},
    "code": {"type": "string", "minLength": 3, "maxLength": 6},
    "tags": {"type": "array", "items": {"type": "string"}},
    "either": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "integer"}]},
    "maybe": {"type": ["string", "null"]},
    "inner": {"$ref": "#/$defs/inner"},
    "exact": {"type": "string", "minLength": 2, "maxLength": 2}},
    "required": ["name", "code", "tags", "either", "inner", "exact"],
    "$defs": {"inner": {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}}}


@pytest.fixture(scope="module")
def shell() -> tuple[GrammarCompiler, list[str]]:
    tok = AutoTokenizer.from_pretrained("deploy/models/shell")
    compiler = GrammarCompiler(tok, len(tok), {tok.eos_token_id}, bounds=BOUNDS)
    return compiler, [tok.decode([i]) for i in range(compiler.info.vocab_size)]


def _allowed(words: torch.Tensor, vocab: int) -> list[int]:
    bits = ((words[0].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1).flatten()[:vocab]
    return bits.nonzero().flatten().tolist()


def test_unrolled_strings_allow_exactly_what_the_counted_form_allows(shell) -> None:
    compiler, texts = shell
    counted = xgr.Grammar.from_json_schema(json.dumps(bounded(SCHEMA, BOUNDS)), any_whitespace=False,
                                           separators=SEPARATORS, strict_mode=True)
    chained = _unrolled(compiler._schema_grammar(SCHEMA))
    assert "_characters{0, 16}" in str(counted) and "_characters{" not in str(chained)
    # strings of the same characters and the same number of optional ones share a chain: 16, 3, 4, 0
    assert str(chained).count("_upto0 ::=") == 4, str(chained)
    a, b = (compiler._compiler.compile_grammar(g) for g in (counted, chained))
    vocab = compiler.info.vocab_size
    rng = random.Random(7)
    for walk in range(9):
        writing = walk % 3 != 0  # two walks in three never close a string early: every string reaches its bound
        ma, mb = xgr.GrammarMatcher(a), xgr.GrammarMatcher(b)
        wa, wb = xgr.allocate_token_bitmask(1, vocab), xgr.allocate_token_bitmask(1, vocab)
        picks: list[int] = []
        while not ma.is_terminated() and len(picks) < 600:
            ma.fill_next_token_bitmask(wa)
            mb.fill_next_token_bitmask(wb)
            assert torch.equal(wa, wb), f"walk {walk}, token {len(picks)}: {''.join(texts[t] for t in picks)!r}"
            allowed = _allowed(wa, vocab)
            quote_free = [t for t in allowed if '"' not in texts[t] and texts[t].isascii() and t not in compiler.end_ids]
            quote = [t for t in allowed if texts[t] == '"'] if writing else []  # opens a string, or closes one at its bound
            pick = rng.choice(quote_free if quote_free and (writing or rng.random() < 0.8) else quote or allowed)
            assert ma.accept_token(pick) and mb.accept_token(pick)
            picks.append(pick)
        assert ma.is_terminated() and mb.is_terminated(), f"walk {walk} did not end"
        reply = json.loads("".join(texts[t] for t in picks if t not in compiler.end_ids))
        jsonschema.validate(reply, SCHEMA)
        if writing:
            assert (len(reply["name"]), len(reply["code"]), len(reply["exact"]), len(reply["inner"]["note"])) == (16, 6, 2, 16)


def test_the_chain_carries_the_closing_quote_and_long_bounds_stay_counted() -> None:
    text = ('root ::= (("{" "\\"a\\"" ": " root_prop_0 ", " "\\"b\\"" ": " root_prop_1 "}"))\n'
            'root_prop_0 ::= (("\\"" root_prop_0_characters{2, 4} "\\""))\nroot_prop_0_characters ::= (([^\\"\\\\\\r\\n]))\n'
            'root_prop_1 ::= (("\\"" root_prop_1_characters{0, 2} "\\""))\nroot_prop_1_characters ::= (([^\\"\\\\\\r\\n]))\n')
    out = unroll_bounded_strings(text)
    assert 'root_prop_0 ::= "\\"" root_prop_0_characters root_prop_0_characters root_prop_0_characters_upto2' in out
    assert 'root_prop_0_characters_upto0 ::= "\\""' in out
    assert 'root_prop_0_characters_upto2 ::= "\\"" | root_prop_0_characters root_prop_0_characters_upto1' in out
    assert "upto3" not in out
    # the second string has the same characters and 2 optional ones: it shares the first one's chain
    assert 'root_prop_1 ::= "\\"" root_prop_0_characters_upto2' in out and "root_prop_1_characters_upto" not in out
    long = text.replace("{2, 4}", "{0, %d}" % (UNROLL_MAX + 1)).replace("{0, 2}", "{0, %d}" % (UNROLL_MAX + 1))
    assert unroll_bounded_strings(long) == long
    # a rule name already taken is not reused
    taken = text + "root_prop_0_characters_upto7 ::= \"x\"\n"
    assert "root_prop_0_characters_upto_0 ::=" in unroll_bounded_strings(taken)


def test_a_tool_calls_grammar_shares_one_chain_across_its_tools(shell) -> None:
    """The tool call's body (every offered tool's arguments) is unrolled as a whole: three bounded strings
    in two tools make one chain, so compile time does not grow with the strings (each rule of a chain
    costs ~7 ms at a 49,152-token vocabulary)."""
    from specialists.wire import GrammarSpec, ToolGrammar

    compiler, _ = shell
    one = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    two = {"type": "object", "properties": {"b": {"type": "string"}, "c": {"type": "string"}}, "required": ["b"]}
    made = compiler.compile(GrammarSpec(kind="tool_call", tools=[ToolGrammar(name="f", parameters=one),
                                                                 ToolGrammar(name="g", parameters=two)]))
    text = str(made.compiled.grammar)
    assert "{0, 16}" not in text and text.count("_upto0 ::=") == 1 and text.count("_upto16 ::=") == 1
