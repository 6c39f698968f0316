"""Grammar masks inside a static step's graph (a GPU's guided verify and decode).

A static step whose rows follow a grammar replays a variant of its graph that masks the logits
(specialists/ops/grammar_mask.apply_bitmask) before the argmax, so that its greedy acceptance, the
packed result and the drafter's rebuild stay in the graph as for free steps. The graph reads its masks
from static buffers per padded token count: the host writes the step's mask words (spec/grammar.py
StepMasks.words: one row per logits row, then a close flag) into a pinned buffer, padding rows allow
everything, and one queued copy takes them to the device before the replay. The closing preference the
kernel adds on flagged rows sits in one static [V] buffer, copied when the grammars' closers change.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class StaticMask(NamedTuple):
    words: torch.Tensor  # [Tp, W + 1] int32 on the device
    bonus: torch.Tensor  # [V] float32 on the device

    def apply(self, logits: torch.Tensor) -> None:  # [Tp, V] in place (inside a graph)
        from specialists.ops.grammar_mask import apply_bitmask  # Triton: imported where it runs

        apply_bitmask(logits, self.words, self.bonus)


class StaticMasks:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.words = (vocab_size + 31) // 32 + 1
        self.device = device
        self.bonus = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self._bonus_src: torch.Tensor | None = None
        self._bufs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def buffers(self, tokens: int) -> StaticMask:
        """The static buffers of a step of `tokens` padded tokens (made on first use: at capture)."""
        if tokens not in self._bufs:
            host = torch.full((tokens, self.words), -1, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            host[:, -1] = 0
            self._bufs[tokens] = (host, host.to(self.device))
        return StaticMask(self._bufs[tokens][1], self.bonus)

    def host(self, tokens: int) -> torch.Tensor:
        """The pinned host buffer [tokens, W + 1] whose copy `stage` queues: StepMasks.words may write
        the step's words straight into it (padding rows included)."""
        self.buffers(tokens)
        return self._bufs[tokens][0]

    def stage(self, tokens: int, words: torch.Tensor, bonus: torch.Tensor | None) -> StaticMask:
        """words [R <= tokens, W + 1] (host) for the real rows, or the `host` buffer written whole; bonus
        [V] on the device (None: no row closes) -> the graph's buffers, filled (the copy queued on the stream)."""
        mask = self.buffers(tokens)
        host = self._bufs[tokens][0]
        if words.data_ptr() != host.data_ptr():
            R = words.shape[0]
            host[:R] = words
            host[R:, :-1] = -1
            host[R:, -1] = 0
        mask.words.copy_(host, non_blocking=True)
        if bonus is not None and bonus.numel() == self.bonus.numel() and bonus is not self._bonus_src:
            self.bonus.copy_(bonus)
            self._bonus_src = bonus
        return mask
