"""Grammar-constrained decoding under speculation: a token mask per row and position, drafts proposed
under it, and the grammar state committed with exactly the kept tokens (the same commit as KV and SSM).

A sequence with a grammar carries a `Guide`: a matcher (duck-typed; specialists/grammar.py wraps
xgrammar's GrammarMatcher) and whether it constrains now (a tool call's grammar waits for the
`<tool_call>` token). One speculative step of a guided row, with drafts d1..dk:

  draft    before the drafter picks d_j the host fills the mask of the state after d_1..d_{j-1} and
           the drafter's logits are masked with it (`DraftMasks.for_depth`); d_j is then fed to the
           matcher (a draft that the grammar refuses ends the row's drafts: none should, they are
           masked); after the chain the mask after d_k is filled too, and the matcher is rolled back
           by every draft it took: the state is the committed one again
  verify   the target's logits at position j (after [last, d1..d_j]) are masked with mask j, on the
           device, before acceptance: greedy takes the masked argmax, rejection sampling the masked
           (renormalised) distribution, so it stays lossless with respect to the masked target
  commit   the engine feeds the matcher the tokens it kept (after its trigger cut)

A row that does not draft (a prefill, a plain step) gets mask 0 only. Masks are xgrammar's bitmask
layout (int32 words [n, ceil(V / 32)], bit b of word w allows token 32 w + b), filled on the host,
sent from pinned memory without a sync. A step with a guided row keeps its static verify (a CUDA graph)
but never multi-step decodes or drafts made ahead; its chain reads each depth's drafts on the host (on
a GPU a sync per depth but those whose masks allow one token, specialists/drafter_guided.py). Near the
end of a reply's budget the allowed closing tokens come first (`_close`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from spec.mask_buffers import CLOSE_BONUS, MaskBuffers, host_words
from state.transfer import device_ints


class GrammarViolation(RuntimeError):
    """The engine kept a token the request's grammar refuses (a bug: every kept token was masked)."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bits [n, W] int32 (any device) -> allowed [n, vocab_size] bool on the same device."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    return ((bits.unsqueeze(-1) >> shifts) & 1).bool().reshape(bits.shape[0], -1)[:, :vocab_size]


def _np(t: Any) -> np.ndarray:  # a host tensor's numpy view (numpy arrays as they are: no torch dispatch)
    return t if isinstance(t, np.ndarray) else t.numpy()


@torch.inference_mode()
def apply_masks(logits: torch.Tensor, rows: list[int], bits: torch.Tensor, src: list[int] | None = None) -> None:
    """logits [N, V] (in place): rows[i] keeps only the tokens that bits[src[i]] allows (-inf elsewhere);
    bits [M, W] on the host (pinned for a GPU: no sync), src None: bits[i]."""
    if not rows:
        return
    dev = logits.device
    if dev.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():  # numpy: ~4 ops, not ~8 dispatches
        w = bits.numpy() if src is None else bits.numpy()[src]
        allowed = np.unpackbits(w.view(np.uint8), axis=-1, count=logits.shape[1], bitorder="little").view(bool)
        lg = logits.numpy()
        lg[rows] = np.where(allowed, lg[rows], np.float32(-np.inf))
        return
    words = bits.to(dev, non_blocking=True)
    if src is not None:
        words = words.index_select(0, device_ints(src, dev))
    allowed = unpack_bitmask(words, logits.shape[1])  # [n, V]
    idx = device_ints(rows, dev)
    logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill(~allowed, float("-inf")))


@dataclass
class Guide:
    """A sequence's grammar. `activate_on_tool_open`: it starts constraining at the `<tool_call>` token
    (a tool call under tool_choice auto); otherwise from the first output token."""

    matcher: Any  # fill_next_token_bitmask(bits, index), accept_token(id) -> bool, rollback(n), is_terminated()
    active: bool
    activate_on_tool_open: bool = False
    # closing within the budget: with at most `reserve` tokens left before max_tokens, the allowed tokens
    # that close something come first (`closers` [V]: 2 for `"`-led tokens of `"]}`, 1 for `]` / `}`, 0
    # otherwise, times CLOSE_BONUS): a model inside a string or array closes its JSON before the cut
    closers: torch.Tensor | None = None
    reserve: int = 0
    drafts: int = 0  # drafts proposed under this grammar
    masked_drafts: int = 0  # drafts the mask changed (the drafter's own choice was not allowed)
    mask_s: float = 0.0  # host time filling masks and committing tokens
    # drafts whose free picks reach the host after the chain (a GPU's unread depths): (picks, row, drafts)
    late: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)
    _reported: tuple[int, int, float] = (0, 0, 0.0)

    def commit(self, tokens: list[int]) -> None:
        """The kept tokens of a step, in order (KV and SSM keep the same ones)."""
        t0 = time.perf_counter()
        for t in tokens:
            if not self.matcher.accept_token(int(t)):
                raise GrammarViolation(f"token {t} was kept but the grammar refuses it")
        if self.matcher.is_terminated():  # its end was kept: nothing left to constrain
            self.active = False
        self.mask_s += time.perf_counter() - t0

    def take_counts(self) -> tuple[int, int, float]:
        """(drafts, masked drafts, mask seconds) since the last call, after the step's sync (late picks in)."""
        for picks, i, n in self.late:  # a host tensor: numpy, no torch dispatch
            p = picks.numpy()
            self.masked_drafts += int(np.count_nonzero(p[:n, 0, i] != p[:n, 1, i]))
        self.late.clear()
        out = (self.drafts - self._reported[0], self.masked_drafts - self._reported[1], self.mask_s - self._reported[2])
        self._reported = (self.drafts, self.masked_drafts, self.mask_s)
        return out

    def tool_opened(self) -> None:
        if self.activate_on_tool_open:
            self.active = True


def active_guide(seq: Any) -> Guide | None:
    g = getattr(seq, "guide", None)
    return g if g is not None and g.active else None


@dataclass
class StepMasks:
    """The masks of one step's guided rows: row b (batch order) has masks for positions 0..n_b, filled
    on the host. Rows without a guide are not here."""

    vocab_size: int
    kmax: int
    rows: dict[int, Guide]  # batch row -> its guide
    device: torch.device = torch.device("cpu")  # where the logits are (a GPU: the host buffers are pinned)
    left: dict[int, int] = field(default_factory=dict)  # batch row -> tokens it may still emit (position 0)
    # a GPU's fused apply (specialists/ops/grammar_mask.apply_bitmask: logits, words, bonus), and the
    # device copies of closing preferences it adds (id(closers) -> (closers, bonus)); None: the torch ops
    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
    buffers: "MaskBuffers | None" = None  # host / device buffers reused across steps (None: this step's own)
    bits: torch.Tensor = field(init=False)  # [len(rows), kmax + 1, W] int32, host
    _rows: list[torch.Tensor] = field(init=False)  # bits[i] per slot (a view made once, not per fill)
    slot: dict[int, int] = field(init=False)  # batch row -> index into bits
    filled: dict[int, int] = field(init=False)  # batch row -> positions filled (1 + drafts it may verify)
    mask_s: float = 0.0

    def __post_init__(self) -> None:
        if self.buffers is None:  # fresh buffers for this step only
            self.buffers = MaskBuffers(self.device)
        # positions are read only once filled, so a reused buffer needs no reset
        self.bits, self._rows = self.buffers.host_rows("bits", (len(self.rows), self.kmax + 1, bitmask_words(self.vocab_size)))
        self.slot = {b: i for i, b in enumerate(self.rows)}
        self.filled = {b: 0 for b in self.rows}

    def fill(self, b: int) -> None:
        """The mask of row b's next position, from its matcher's current state."""
        t0 = time.perf_counter()
        j = self.filled[b]
        self.rows[b].matcher.fill_next_token_bitmask(self._rows[self.slot[b]], j)
        self.filled[b] = j + 1
        self.mask_s += time.perf_counter() - t0

    def fill_first(self) -> None:
        """Mask 0 of every guided row (the committed state)."""
        for b in self.rows:
            if self.filled[b] == 0:
                self.fill(b)

    def apply(self, logits: torch.Tensor, counts: list[int]) -> None:
        """Masks the step's logits [N, V] in place; counts[b]: row b's logits rows (1 for a prefill,
        1 + k for a verify). Positions past a row's filled masks are left alone (never kept)."""
        if self.kernel is not None:
            self._apply_fused(logits, counts)
            return
        rows, src = [], []
        start = 0
        k1 = self.kmax + 1
        for b, m in enumerate(counts):
            if b in self.rows:
                n = min(m, self.filled[b])
                rows.extend(range(start, start + n))
                src.extend(range(self.slot[b] * k1, self.slot[b] * k1 + n))
            start += m
        apply_masks(logits, rows, self.bits.view(-1, self.bits.shape[-1]), src)
        self._close(logits, counts)

    def words(self, counts: list[int], out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's mask words per logits row (counts as for apply) -> (host [R, W + 1] int32: the row's
        mask, all allowed for rows not guided, positions past the filled ones and `out`'s rows past R,
        then its close flag by _close's rule; the closers the flagged rows use, or None)."""
        R, W = sum(counts), self.bits.shape[-1]
        words = self.buffers.host("words", (R, W + 1)) if out is None else out
        w, bits = words.numpy(), self.bits.numpy()  # host tensors: numpy's indexing costs no dispatch
        w[:, :W] = -1
        w[:, W] = 0
        closers = None
        start = 0
        for b, m in enumerate(counts):
            g = self.rows.get(b)
            if g is not None:
                n = min(m, self.filled[b])
                w[start:start + n, :W] = bits[self.slot[b], :n]
                if g.closers is not None and b in self.left:
                    closers = g.closers
                    w[start:start + n, W] = self.left[b] - np.arange(n) <= g.reserve
            start += m
        return words, closers

    def _apply_fused(self, logits: torch.Tensor, counts: list[int]) -> None:
        """apply in one copy and one kernel (self.kernel)."""
        words, closers = self.words(counts)
        self.kernel(logits[:words.shape[0]], self.buffers.device_copy("words", words), self.buffers.bonus(closers))

    def _close(self, logits: torch.Tensor, counts: list[int]) -> None:
        """Positions within a guide's reserve of its budget: closing tokens first (CLOSE_BONUS added to
        their masked logits; a disallowed one stays at -inf). The same at a verify row and a plain decode
        of that position, so greedy output with speculation still equals it without."""
        rows, closers = [], None
        start = 0
        for b, m in enumerate(counts):
            g = self.rows.get(b)
            if g is not None and g.closers is not None and b in self.left:
                for j in range(min(m, self.filled[b])):
                    if self.left[b] - j <= g.reserve:
                        rows.append(start + j)
                closers = g.closers
            start += m
        if not rows:
            return
        bonus = closers.to(logits.device, non_blocking=True).to(logits.dtype) * CLOSE_BONUS  # [V]
        idx = device_ints(rows, logits.device)
        with torch.inference_mode():
            logits.index_copy_(0, idx, logits.index_select(0, idx) + bonus[: logits.shape[1]])


class DraftMasks:
    """The drafter chain's side of a step's masks, for the chain's rows `chain_rows` (batch rows, in
    the chain's order): `depth_words(j, last, out)` feeds draft j-1 (host ids) to the matchers and
    writes the masks for draft j; `finish_host(last, drafted)` fills the mask after the last draft and
    rolls every matcher back. `for_depth` / `note` / `finish` are the same for the torch chain, on
    device tensors. `counts[i]`: drafts chain row i may verify (a refused draft ends it)."""

    def __init__(self, masks: StepMasks, chain_rows: list[int], k: int, draft_vocab: torch.Tensor | None,
                 device: torch.device) -> None:
        self.masks, self.k = masks, k
        self.guided = [(i, b) for i, b in enumerate(chain_rows) if b in masks.rows]
        self.n = len(chain_rows)
        self.counts = [k] * self.n
        self.taken = {b: 0 for _, b in self.guided}  # drafts each matcher has accepted this step
        self.vocab = draft_vocab
        self.device = device
        self._unmasked: list[Any] = []  # per depth: [n] whether the mask changed the draft (tensor or list)
        self._late: torch.Tensor | None = None  # [L, 2, Bp] the depths after those in _unmasked (note_late)

    @property
    def words(self) -> int:
        return self.masks.bits.shape[-1]

    def _feed(self, j: int, host: list[int]) -> None:
        """Draft j-1 (host ids [n]) into each guided row still drafting; then that row's mask j."""
        for i, b in self.guided:
            if self.counts[i] < j:  # ended already
                continue
            m = self.masks.rows[b].matcher
            t0 = time.perf_counter()
            ok = not m.is_terminated() and m.accept_token(int(host[i]))
            self.masks.mask_s += time.perf_counter() - t0
            if not ok:
                self.counts[i] = j - 1
                continue
            self.taken[b] += 1
            if m.is_terminated():  # draft j-1 ends the grammar (an end of turn): the row's last draft
                self.counts[i] = j
                continue
            self.masks.fill(b)

    def depth_words(self, j: int, last: list[int] | None, out: torch.Tensor) -> None:
        """out [n, W] (host): the bitmasks for draft j; rows not guided or no longer drafting allow all.
        `last`: draft j-1 of every chain row (None for j = 0)."""
        if j == 0:
            for _, b in self.guided:
                if self.masks.filled[b] == 0:
                    self.masks.fill(b)
        else:
            self._feed(j, last)
        o, bits = _np(out), self.masks.bits.numpy()  # host tensors: numpy's indexing costs no dispatch
        o.fill(-1)
        for i, b in self.guided:
            if self.counts[i] >= j + 1:
                o[i] = bits[self.masks.slot[b], j]

    def for_depth(self, j: int, last: torch.Tensor | None) -> torch.Tensor | None:
        """-> allowed [n, N] bool over the drafter's vocabulary for draft j (0-based), None if no row is
        guided. `last`: draft j-1 of every chain row on the device (None for j = 0)."""
        if not self.guided:
            return None
        bits = host_words((self.n, self.words), self.device)
        self.depth_words(j, None if last is None else last.tolist(), bits)
        allowed = unpack_bitmask(bits.to(self.device, non_blocking=True), self.masks.vocab_size)
        return allowed if self.vocab is None else allowed[:, self.vocab]

    def note(self, j: int, chosen: torch.Tensor, unmasked: torch.Tensor) -> None:
        """Draft j as chosen under the mask and as the drafter would have chosen it (both [n], device)."""
        self._unmasked.append((chosen != unmasked))

    def note_host(self, chosen: list[int], unmasked: list[int]) -> None:
        """The next depth's drafts as chosen and unmasked, host ids."""
        self._unmasked.append([a != b for a, b in zip(chosen, unmasked)])

    def forced(self, j: int, out: torch.Tensor, allowed: Any = None) -> list[int] | None:
        """Draft j of every chain row known on the host without a read, or None: each guided row still
        drafting has a mask (out [n, W], from depth_words) allowing one token, of the draft vocabulary
        (allowed [V] bool, None: all): the masked argmax. Other rows are never fed: 0 stands in."""
        words = _np(out).view(np.uint32)
        known = [0] * self.n
        for i, _ in self.guided:
            if self.counts[i] < j + 1:  # ended: nothing of it is read
                continue
            row = words[i]
            if np.count_nonzero(row) != 1:  # (no array made: most depths are not forced)
                return None
            at = int(row.argmax())
            w = int(row[at])
            tok = at * 32 + w.bit_length() - 1
            if w & (w - 1) or tok >= self.masks.vocab_size or (allowed is not None and not allowed[tok]):
                return None
            known[i] = tok
        return known

    def note_late(self, picks: torch.Tensor) -> None:
        """picks [L, 2, Bp] (host, read after the step's sync): the last L depths' masked and free picks."""
        self._late = picks

    def finish(self, last: torch.Tensor, drafted: int) -> None:
        """finish_host with the last drafts on the device."""
        if self.guided:
            self.finish_host(last.tolist(), drafted)

    def finish_host(self, last: list[int], drafted: int) -> None:
        """After the chain (`drafted` drafts per row; `last`: the last one, host ids): the mask after
        the last draft, then every matcher rolled back to the committed state; the counts into the guides."""
        if not self.guided:
            return
        self._feed(drafted, last)
        if self._unmasked and isinstance(self._unmasked[0], torch.Tensor):
            changed = torch.stack(self._unmasked, dim=1).tolist()
        else:
            changed = [list(col) for col in zip(*self._unmasked)] if self._unmasked else [[] for _ in range(self.n)]
        for i, b in self.guided:
            g = self.masks.rows[b]
            n = min(self.counts[i], drafted)
            self.counts[i] = n
            g.drafts += n
            g.masked_drafts += sum(changed[i][:n])
            if self._late is not None and n > len(self._unmasked):
                g.late.append((self._late, i, n - len(self._unmasked)))
            if self.taken[b]:
                g.matcher.rollback(self.taken[b])
