"""Packed token streams for training and the deterministic batch sampler.

A domain's packed split is a folder of .npy files (see pack.py):
  text.npy        uint16 [N]  raw-corpus documents, each followed by <|endoftext|>
  chat.npy        uint16 [M]  rendered conversations, each followed by <|endoftext|>
  chat_mask.npy   uint8  [M]  1 on assistant tokens (the only chat tokens that carry loss)
  chat_starts.npy int64  [C]  offset of each conversation in chat.npy
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class TokenStreams:
    text: np.ndarray  # [N] uint16
    chat: np.ndarray  # [M] uint16
    chat_mask: np.ndarray  # [M] uint8
    chat_starts: np.ndarray  # [C] int64

    @classmethod
    def load(cls, folder: Path) -> "TokenStreams":
        folder = Path(folder)
        return cls(*(np.load(folder / f"{name}.npy", mmap_mode="r") for name in ("text", "chat", "chat_mask", "chat_starts")))

    @property
    def num_tokens(self) -> int:
        return int(self.text.shape[0] + self.chat.shape[0])


@dataclass
class Batch:
    inputs: torch.Tensor  # [B, S] int64
    labels: torch.Tensor  # [B, S] int64 (next tokens)
    loss_mask: torch.Tensor  # [B, S] float32

    def to(self, device: str | torch.device) -> "Batch":
        return Batch(self.inputs.to(device, non_blocking=True), self.labels.to(device, non_blocking=True), self.loss_mask.to(device, non_blocking=True))


def sample_batch(streams: TokenStreams, batch_size: int, seq_len: int, chat_fraction: float, seed: int, step: int) -> Batch:
    """Rows are either a random window of raw text (loss everywhere) or a window that starts at a
    conversation boundary (loss on assistant tokens). Deterministic in (seed, step), so a resumed
    run sees the batches it would have seen."""
    rng = np.random.default_rng([seed, step])
    n_chat = int(round(batch_size * chat_fraction)) if streams.chat.shape[0] > seq_len + 1 else 0
    inputs = np.empty((batch_size, seq_len + 1), dtype=np.int64)
    mask = np.ones((batch_size, seq_len), dtype=np.float32)
    starts = streams.chat_starts[streams.chat_starts < streams.chat.shape[0] - seq_len - 1]
    for row in range(batch_size):
        if row < n_chat and len(starts):
            o = int(starts[rng.integers(len(starts))])
            inputs[row] = streams.chat[o : o + seq_len + 1]
            mask[row] = streams.chat_mask[o + 1 : o + seq_len + 1]
        else:
            o = int(rng.integers(0, streams.text.shape[0] - seq_len - 1))
            inputs[row] = streams.text[o : o + seq_len + 1]
    t = torch.from_numpy(inputs)
    return Batch(t[:, :-1].contiguous(), t[:, 1:].contiguous(), torch.from_numpy(mask))
