"""The MTP drafter's CPU path through the native kernels (specialists/ops/native.py): a rebuild and a
whole greedy chain each in one call, instead of ~15 torch ops per depth and the Python between them.

Same computation as PagedDrafter's torch path (norms as x / |x| with the gains folded into the
weights, int8 products, RoPE from the drafter's signed table, entries in the pool through the target's
block tables, chained entries in a dense tail), with int16 activations instead of bf16. Drafts only
propose, so the two paths need not agree bit for bit; tests/test_native.py checks that they draft alike.
Used for greedy chains, under a grammar too (a call back to the host before each depth); a chain
with a confidence floor stays in torch.
"""

from __future__ import annotations

from typing import Any

import torch

from specialists.models.batch import ForwardBatch
from specialists.ops import native
from specialists.ops.linear import _Int8Linear

__all__ = ["NativeDrafter", "native_drafter"]


def native_drafter(drafter: Any) -> "NativeDrafter | None":
    """A NativeDrafter for a PagedDrafter on the CPU whose products run natively, else None."""
    mms = (drafter.mm_hidden, drafter.mm_qkv, drafter.mm_o, drafter.mm_gate_up, drafter.mm_down, drafter.mm_head)
    if not (native.available() and drafter.k.dtype == torch.float32 and drafter.k.device.type == "cpu"
            and all(isinstance(m, _Int8Linear) and m.native for m in mms) and drafter.cfg.head_dim <= 1024):
        return None
    return NativeDrafter(drafter)


class NativeDrafter:
    def __init__(self, drafter: Any) -> None:
        self.d = drafter
        w = drafter.weights
        self._p = native.Addresses()
        ptrs: list[int] = []
        for m in (drafter.mm_hidden, drafter.mm_qkv, drafter.mm_o, drafter.mm_gate_up, drafter.mm_down, drafter.mm_head):
            ptrs += [self._p(m.w), self._p(m.scale32)]
        vocab = None if drafter.vocab is None else drafter.vocab.to(torch.int64)
        ptrs += [self._p(w.token_proj.float()), self._p(vocab), self._p(drafter.k), self._p(drafter.v)]
        self.table = torch.tensor(ptrs, dtype=torch.int64)
        cfg = drafter.cfg
        self.dims = [0, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                     drafter.mm_down.w.shape[1], drafter.block_size, 0, 1, drafter.mm_head.w.shape[0], w.token_proj.shape[0]]
        self.floats = torch.tensor([drafter.scale], dtype=torch.float32)

    def _ints(self, rows: int, width: int) -> torch.Tensor:
        self.dims[0], self.dims[7], self.dims[8] = rows, width, torch.get_num_threads()
        return torch.tensor(self.dims, dtype=torch.int32)

    def rebuild(self, batch: ForwardBatch, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """PagedDrafter.rebuild: entries for every token of the target's batch -> outputs [T, d]."""
        T = hidden.shape[0]
        out = torch.empty(T, self.dims[1], dtype=torch.float32)
        if T == 0:
            return out
        self.d._grow(batch.max_context_len + 1)
        i64 = native.int64
        pos = i64(batch.positions)
        cs = self.d.rope.table[pos + 1].contiguous()  # [T, 2, 1, hd]
        tables = i64(batch.block_tables)
        h, toks = hidden.float().contiguous(), i64(next_tokens)
        slots, seq = i64(batch.slot_mapping), i64(batch.token_seq)
        ints = self._ints(T, tables.shape[1])  # held: a temporary's memory would be freed before the call
        rc = native.library().cantata_mtp_rebuild(
            ints.data_ptr(), self.floats.data_ptr(), h.data_ptr(), toks.data_ptr(), out.data_ptr(),
            cs.data_ptr(), pos.data_ptr(), slots.data_ptr(), seq.data_ptr(), tables.data_ptr(), self.table.data_ptr())
        if rc:
            raise MemoryError("the native drafter rebuild could not allocate its scratch")
        return out

    def chain(self, prev: torch.Tensor, committed: list[int], tables: torch.Tensor, k: int,
              guide: Any = None) -> torch.Tensor:
        """PagedDrafter.chain without a confidence floor -> drafts [B, k] int64. With a guide
        (spec.grammar.DraftMasks over these rows) each draft is the best token its grammar allows: the
        kernel calls back before each depth, the guide reads the drafts so far and writes the depth's
        bitmasks (as the GPU's guided chain does between its graphs); guide.counts holds what each row
        may verify after."""
        B = prev.shape[0]
        drafts = torch.empty(B, k, dtype=torch.int64)
        self.d._grow(max(committed) + k + 1)
        rope = self.d.rope.table  # [P, 2, 1, hd], contiguous
        c = torch.tensor(committed, dtype=torch.int64)
        tab = native.int64(tables)
        p = prev.float().contiguous()
        ints = self._ints(B, tab.shape[1])
        words = free = None
        depth = native.DEPTH_FN()  # a null pointer: no grammar
        errors: list[BaseException] = []
        if guide is not None:
            words = torch.full((B, guide.words), -1, dtype=torch.int32)
            free = torch.empty(B, k, dtype=torch.int64)

            def on_depth(j: int) -> int:  # draft j-1 is in drafts; draft j's masks into words
                try:
                    last = None
                    if j:
                        last = drafts[:, j - 1].tolist()
                        guide.note_host(last, free[:, j - 1].tolist())
                    guide.depth_words(j, last, words)
                    return 0
                except BaseException as e:  # noqa: BLE001 - an exception cannot cross the C frames
                    errors.append(e)
                    return 1

            depth = native.DEPTH_FN(on_depth)
        rc = native.library().cantata_mtp_chain(
            ints.data_ptr(), self.floats.data_ptr(), p.data_ptr(), c.data_ptr(), tab.data_ptr(),
            rope.data_ptr(), rope.shape[0], k, drafts.data_ptr(), self.table.data_ptr(),
            None if words is None else words.data_ptr(), 0 if words is None else words.shape[1],
            None if free is None else free.data_ptr(), depth)
        if errors:
            raise errors[0]
        if rc:
            raise RuntimeError(f"the native drafter chain failed ({rc})")
        if guide is not None:
            last = drafts[:, k - 1].tolist()
            guide.note_host(last, free[:, k - 1].tolist())
            guide.finish_host(last, k)
        return drafts
