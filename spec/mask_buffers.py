"""Host and device buffers that every step's grammar masks reuse (spec/grammar.py's StepMasks), and the
closing bonus's device copies."""

from __future__ import annotations

import math
from typing import Any

import torch


CLOSE_BONUS = 1.0e4  # added to the closing tokens' logits near the budget's end (above any real logit gap)


def host_words(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An all-allowed bitmask buffer on the host; pinned when the masks go to a GPU, so that their copy
    is queued instead of waiting for the stream (state/transfer.py)."""
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=torch.device(device).type == "cuda")


class MaskBuffers:
    """Host buffers (pinned for a GPU) and device buffers that every step's masks reuse, grown as
    needed: a step's copies out of them have run by the step's one sync, before the next step writes
    them. And the device copies of the closing preferences (one per grammar compiler)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._host: dict[str, torch.Tensor] = {}
        self._views: dict[tuple, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # (name, shape) -> view, its rows
        self._dev: dict[str, torch.Tensor] = {}
        self._bonus: dict[int, tuple[Any, torch.Tensor]] = {}

    def host(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.host_rows(name, shape)[0]

    def host_rows(self, name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The host buffer `name` viewed as `shape`, and that view's rows (made once per shape: torch
        indexing costs microseconds a call on a GPU's host)."""
        hit = self._views.get((name, shape))
        if hit is not None:
            return hit
        n = math.prod(shape)
        buf = self._host.get(name)
        if buf is None or buf.numel() < n:
            buf = self._host[name] = host_words((max(n, 2 * (0 if buf is None else buf.numel())),), self.device)
            self._views = {k: v for k, v in self._views.items() if k[0] != name}  # views of the old buffer
        view = buf[:n].view(shape)
        hit = self._views[(name, shape)] = (view, list(view))
        return hit

    def device_copy(self, name: str, src: torch.Tensor) -> torch.Tensor:
        """src (a host buffer of this object) on the device, queued (no sync on a GPU)."""
        if self.device.type != "cuda":
            return src
        buf = self._dev.get(name)
        if buf is None or buf.numel() < src.numel():
            buf = self._dev[name] = torch.empty(max(src.numel(), 2 * (0 if buf is None else buf.numel())),
                                                dtype=src.dtype, device=self.device)
        out = buf[:src.numel()].view(src.shape)
        out.copy_(src, non_blocking=True)
        return out

    def bonus(self, closers: torch.Tensor | None) -> torch.Tensor:
        """CLOSE_BONUS * closers on the device (a placeholder the kernel never reads when no row closes)."""
        hit = self._bonus.get(id(closers))
        if hit is None:  # the closers object is kept, so its id is not reused
            bonus = torch.zeros(1, device=self.device) if closers is None else (closers.float() * CLOSE_BONUS).to(self.device)
            hit = self._bonus[id(closers)] = (closers, bonus)
        return hit[1]
