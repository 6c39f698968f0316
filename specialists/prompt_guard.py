"""Tokenizing a prompt off the engine's thread, after a cheap length bound.

The engine refuses a prompt of `max_model_len` tokens or more, but learning that by tokenizing a
10 MB prompt took 13 s, on the thread that steps every other request. `PromptEncoder` first
compares the prompt's length in characters with the most that `max_model_len - 1` tokens could
ever spell (the longest token in the vocabulary, in characters, times the limit; a tokenizer with a
normalizer gets 4x headroom, since normalization can shrink text); longer prompts are refused
without tokenizing. Prompts under the bound are tokenized in the specialist's own single worker
thread (`encode_async`), so the engine thread only ever gets token ids.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

NORMALIZER_HEADROOM = 4


class PromptTooLong(ValueError):
    """The prompt cannot fit the model's context."""


def longest_token_chars(tokenizer: Any) -> int:
    """Characters in the longest entry of the vocabulary (added tokens included). For byte-level
    BPE the entries are in the byte alphabet (one character per byte), so this bounds the text one
    token can cover from above."""
    vocab = tokenizer.get_vocab()
    return max((len(token) for token in vocab), default=1) or 1


def has_normalizer(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    return getattr(backend, "normalizer", None) is not None


class PromptEncoder:
    def __init__(self, tokenizer: Any, max_model_len: int, name: str = "specialist") -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        headroom = NORMALIZER_HEADROOM if has_normalizer(tokenizer) else 1
        self.max_chars = max_model_len * longest_token_chars(tokenizer) * headroom
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tokenize-{name}")

    def encode(self, prompt: str) -> list[int]:
        """Token ids of `prompt`; PromptTooLong, without tokenizing, when it cannot fit."""
        if len(prompt) > self.max_chars:
            raise PromptTooLong(f"the prompt has {len(prompt)} characters, more than {self.max_model_len - 1} tokens "
                                f"of this model can hold (at most {self.max_chars} characters)")
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    async def encode_async(self, prompt: str) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.encode, prompt)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
