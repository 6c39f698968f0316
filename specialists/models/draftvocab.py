"""The drafter's vocabulary as the engine reads it: mtp_vocab.safetensors beside the drafter (tensor
"token_ids", int64, most frequent first; written by `python -m specialists.train draft-vocab`)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

MTP_VOCAB = "mtp_vocab.safetensors"


def read_draft_vocab(directory: Path, size: int | None = None) -> torch.Tensor | None:
    """The first `size` token ids (all when None) of a checkpoint's draft vocabulary, or None when
    it has none."""
    path = Path(directory) / MTP_VOCAB
    if not path.is_file():
        return None
    return load_file(str(path))["token_ids"][:size]
