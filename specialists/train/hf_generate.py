"""Greedy, batched generation with a transformers model (float32, CPU): what `bench.chat_eval` scores
and what `specialists.train.loopexit` collects on-policy replies with. It lives on the training side
so that training never imports bench (bench may import training)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from specialists.chat import EOS_TOKEN


@dataclass
class Reply:
    text: str
    ended: bool  # emitted <|im_end|> within the token budget


def generate(model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int, batch_size: int,
             desc: str = "generate") -> list[Reply]:
    """Greedy, batched, left-padded generation that stops at <|im_end|>."""
    import torch
    from tqdm import tqdm

    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    tokenizer.padding_side = "left"
    limit = getattr(model.config, "max_position_embeddings", None) or 1024
    replies: list[Reply] = []
    for start in tqdm(range(0, len(prompts), batch_size), desc=desc, file=sys.stderr):
        batch = prompts[start: start + batch_size]
        max_prompt = max(1, limit - max_new_tokens)
        enc = tokenizer(batch, add_special_tokens=False, return_tensors="pt", padding=True,
                        truncation=True, max_length=max_prompt)
        with torch.no_grad():
            out = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_id, pad_token_id=pad_id,
            )
        for row in out[:, enc["input_ids"].shape[1]:].tolist():
            ended = eos_id in row
            if ended:
                row = row[: row.index(eos_id) + 1]
            replies.append(Reply(tokenizer.decode(row, skip_special_tokens=False), ended))
    return replies
