"""What the engine hands back: a request's output so far (`RequestOutput`), the error of a request it
cannot serve (`RequestError`, `prompt_ids`), and how a request's speculation status merges step by step."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from spec.stats import RequestStats
from spec.triggers import TriggerSet
from specialists.chat import EOS_TOKEN, PAD_TOKEN
from specialists import detok


class RequestError(ValueError):
    """A request the engine cannot serve (empty or over-long prompt, ids that are not the model's)."""


def prompt_ids(prompt: Any, vocab_size: int) -> list[int]:
    """A prompt given as token ids -> a list of ints in [0, vocab_size); RequestError for anything else
    (a mapping, strings, an id past the embedding: it would fail the whole batch's step, not this one)."""
    try:
        ids = [operator.index(t) for t in prompt]
    except TypeError:
        raise RequestError(f"a prompt is a string or a list of token ids, not {type(prompt).__name__}") from None
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside this model's vocabulary [0, {vocab_size})")
    return ids


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "tool_calls" | "grammar_error" | None while running
    finished: bool
    speculation: str = "off"  # on | off | fallback: what this request used so far
    stats: RequestStats | None = None  # shared, live: read it, do not keep it across steps


def merge_status(before: str, now: str) -> str:
    """A request that ever fell back says so; otherwise on if it ever speculated."""
    if "fallback" in (before, now):
        return "fallback"
    return "on" if "on" in (before, now) else "off"


def cut_run(triggers: Any, tokenizer: Any, max_model_len: int, seq: Any, run: list[int]) -> tuple[int, str | None]:
    """How many of a step's run tokens a sequence keeps: through the first trigger (spec/triggers.py),
    the stop string, max_tokens, max_model_len; -> (kept, the event that cut it)."""
    p = seq.params
    n, event = triggers.cut(run, p.stop_token_ids, p.ignore_eos)
    limit = min(p.max_tokens - len(seq.output_ids), max_model_len - seq.num_tokens)
    if n > limit:
        n, event = limit, None
    if p.stop:
        for i in range(n):
            text = detok.text_of(tokenizer, seq, seq.output_ids + run[: i + 1], advance=False)
            if any(s in text for s in p.stop):
                return i + 1, "stop_string"
    return n, event


def trigger_tokens(tokenizer: Any) -> tuple[set[int], TriggerSet]:
    """The tokenizer's end-of-turn ids (EOS, <|im_end|>, <|endoftext|>) and the trigger set over them and
    the tool call's open and close tokens (None where the vocabulary has none)."""
    tok = tokenizer.convert_tokens_to_ids
    eos = {i for i in (tokenizer.eos_token_id, tok(EOS_TOKEN), tok(PAD_TOKEN)) if isinstance(i, int) and i >= 0}
    call = [i if isinstance(i := tok(n), int) and i != tokenizer.unk_token_id else None for n in ("<tool_call>", "</tool_call>")]
    return eos, TriggerSet(frozenset(eos), *call)
