"""The MTP drafter at inference: its one-layer KV lives in pages that share the target's block ids.

Drafter entry t (see specialists/models/mtp.py) consumes (target hidden h_t, token x_{t+1}) and sits at
rope position t+1. The entry is stored at the KV slot of target token t, so the drafter reads and
writes through the target's block tables and never needs blocks of its own: when the target has
committed C tokens, the drafter holds entries 0..C-1, entry C-1 pairing h_{C-1} with the token the
target just emitted.

Each engine step:
  - `chain`: from each sequence's last entry output, K greedy drafts; depth k >= 2 adds a
    temporary entry at index C + k - 2, held in a dense tail outside the pool. The fused static chain
    (CUDA, specialists/ops/fused.py) writes it into the pool at its own index instead: a slot the
    verify has reserved and the rebuild overwrites.
  - `rebuild`: after verification, entries for every token the target just ran, from the target's
    own hidden states (prefill tokens, or [x, d1..dK] of a verify), overwriting the chained ones. Entries
    past the accepted length are garbage at indices >= the new committed length; nothing reads them
    before the next step overwrites them.
  - `chain_static` / `chain_ahead` (static steps, CUDA graphs on a GPU): the chain in fixed shapes,
    from the host's lists, or drafted on the device right after a greedy verify from its acceptance.

Its folded weights, RoPE table and fused (Triton) static paths are in specialists/drafter_fused.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specialists.drafter_fused import ENTRY_ROWS, DrafterWeights, FusedDrafter, RopeTable
from specialists.drafter_guided import capture_guided_chain, guided_chain
from specialists.drafter_native import native_drafter
from specialists.graphs import GraphCache
from specialists.models.batch import ForwardBatch
from specialists.models.mtp import MTPDrafter
from specialists.models.rope import apply_signed_rope
from specialists.ops.attention import grouped_attention, paged_attention, sdpa, workspace, write_kv
from specialists.ops.linear import proposal_linear
from spec.grammar import DraftMasks
from state.transfer import device_ints


def _fused_ops(fused: bool):
    """specialists.ops.fused when the static paths should use it (CPU tensors need TRITON_INTERPRET=1)."""
    if not fused:
        return None
    from specialists.ops import fused as ops

    return ops


class PagedDrafter:
    def __init__(
        self,
        drafter: MTPDrafter,
        embed: torch.Tensor,  # [V, d] the target's input embedding
        lm_head: torch.Tensor,  # [V, d] the target's lm_head
        *,
        num_blocks: int,
        block_size: int,
        vocab: torch.Tensor | None = None,  # [N] int64 token ids the drafter may propose (None: all)
        min_confidence: float = 0.0,  # stop a chain at the first draft whose probability is below this
        cuda_graphs: bool = False,  # chain_static / chain_ahead as CUDA graphs
        max_positions: int = 4096,  # RoPE positions the tables hold from the start (graphs read them)
        fused: bool = False,  # static chains and rebuilds through Triton kernels
    ) -> None:
        cfg = drafter.cfg
        self.drafter, self.cfg = drafter, cfg
        self.block_size = block_size
        p = next(drafter.parameters())
        # one block past the pool, like the target's KV: the scratch block padding rows write
        shape = (num_blocks + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)  # [num_blocks, block_size, H_kv, hd]
        self.v = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.scratch_block = num_blocks  # the pool's extra block: padding rows read and write only it
        self.rope = RopeTable(cfg.head_dim, cfg.rope_theta, dtype=p.dtype, device=p.device, positions=max_positions)
        self.scale = cfg.head_dim ** -0.5
        self.vocab = None if vocab is None else vocab.to(p.device)
        self.split_qkv = [cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim]
        self.eps = cfg.rms_norm_eps
        self.min_confidence = min_confidence
        self.graphs = GraphCache(cuda_graphs)
        self._static: dict[tuple, tuple] = {}  # (rows, k, width) -> the static inputs of chain_static
        # a static rebuild's entry outputs (its graph writes them here, fused); a static chain reads its
        # sequences' last entries from here inside its graph (any other source is copied in first)
        self._entries = torch.zeros(ENTRY_ROWS, cfg.hidden_size, dtype=p.dtype, device=p.device)
        ops = _fused_ops(fused)
        # Each RMSNorm's gain is folded into the columns of the product that reads it. On the CPU its
        # sqrt(d) too, so a norm is x / |x| (3 cheap ops for F.rms_norm's ~9 us; the eps term is
        # dropped, a relative change of ~eps / mean(x^2), ~1e-5, in a proposal); on a GPU the norm
        # stays F.rms_norm without a gain (one fused kernel).
        self._cpu = p.device.type == "cpu" and ops is None
        self.weights = DrafterWeights.fold(drafter, embed, lm_head, self.vocab, cfg.hidden_size ** 0.5 if self._cpu else 1.0)
        # drafts are proposals (verification decides), so on the CPU the products read int8 copies of
        # the weights (bf16 activations): a quarter of the bytes of the reads that dominate a step
        w = self.weights
        self.mm_qkv, self.mm_o, self.mm_gate_up, self.mm_down, self.mm_hidden, self.mm_head = (
            proposal_linear(m) for m in (w.qkv, w.o, w.gate_up, w.down, w.hidden, w.head))
        self.fused = None if ops is None else FusedDrafter(
            ops, w, self.rope, pool=(self.k, self.v), heads=(cfg.num_attention_heads, cfg.num_key_value_heads),
            eps=self.eps, vocab=self.vocab, entries=self._entries)
        # on a CPU with the native kernels: a rebuild and a plain chain in one call each (drafter_native.py)
        self.native = native_drafter(self) if self._cpu else None

    @property
    def num_speculative_tokens(self) -> int:
        return self.cfg.num_speculative_tokens

    @property
    def chains_in_pool(self) -> bool:
        """Whether a static chain writes its chained entries into the pool (the fused one does)."""
        return self.fused is not None

    def copy_block(self, src: int, dst: int) -> None:
        """The drafter's entries of block src into block dst (specialists/draft_marks.py)."""
        self.k[dst].copy_(self.k[src])
        self.v[dst].copy_(self.v[src])

    def _unit(self, x: torch.Tensor) -> torch.Tensor:  # [T, d] -> RMSNorm without its gain (that is in the next weight)
        if self._cpu:  # x / |x|: the sqrt(d) is in the weight too
            return x / (torch.linalg.vector_norm(x, dim=-1, keepdim=True) + 1e-12)
        return F.rms_norm(x, (x.shape[-1],), None, self.eps)

    def _grow(self, max_pos: int) -> None:  # outside a capture: captured graphs read the table
        self.rope.grow(max_pos, frozen=len(self.graphs) > 0)

    def _qkv(self, x: torch.Tensor, pos: torch.Tensor, max_pos: int):  # x [T, d], pos [T] rope positions <= max_pos
        cfg = self.cfg
        t = x.shape[0]
        nq, nk = self.split_qkv[0], self.split_qkv[1]
        qkv = self.mm_qkv(self._unit(x))
        qk = qkv[:, : nq + nk].view(t, cfg.num_attention_heads + cfg.num_key_value_heads, cfg.head_dim)
        self._grow(max_pos)
        cs = self.rope.table[pos]  # [T, 2, 1, hd]
        qk = apply_signed_rope(qk, cs)  # q and k heads rotated at once
        q, k = qk.split([cfg.num_attention_heads, cfg.num_key_value_heads], dim=1)
        return q, k, qkv[:, nq + nk :].view(t, cfg.num_key_value_heads, cfg.head_dim)

    def _finish(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:  # x [T, d], o [T, H, hd] -> [T, d]
        x = x + self.mm_o(o.reshape(x.shape[0], -1))
        gate, up = self.mm_gate_up(self._unit(x), low=True).chunk(2, dim=-1)  # may stay bf16 into mm_down
        return x + self.mm_down(F.silu(gate) * up)

    def _fuse(self, prev: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:  # [T, d], [T] -> [T, d]
        return self.mm_hidden(self._unit(prev)) + self.weights.token_proj[tokens]

    @torch.inference_mode()
    def rebuild(
        self,
        batch: ForwardBatch,  # the target's batch of this step (its slots and positions)
        hidden: torch.Tensor,  # [T, d] the target's final-normed hidden states of every token
        next_tokens: torch.Tensor,  # [T] int64, the token that follows each one (garbage where not kept)
    ) -> torch.Tensor:  # [T, d] entry outputs
        if self.fused is not None and batch.static:  # rows of one length: a few Triton kernels
            return self.fused.rebuild(batch, hidden.to(self.k.dtype), next_tokens)
        if self.native is not None and not batch.static:
            return self.native.rebuild(batch, hidden, next_tokens)
        x = self._fuse(hidden.to(self.k.dtype), next_tokens.clamp(min=0))
        q, k, v = self._qkv(x, batch.positions + 1, batch.max_context_len)
        write_kv(k, v, self.k, self.v, batch.slot_mapping)
        return self._finish(x, paged_attention(q, self.k, self.v, batch, scale=self.scale, fresh=(k, v)))

    @torch.inference_mode()
    def chain(
        self,
        prev: torch.Tensor,  # [B, d] output of each sequence's last committed entry (index C_b - 1)
        committed: list[int],  # [B] C_b, host
        tables: torch.Tensor,  # [B, W] int32 block tables covering [0, C_b)
        k: int,  # drafts per sequence, at most
        guide: DraftMasks | None = None,  # grammar masks of the guided rows (spec/grammar.py)
    ) -> tuple[torch.Tensor, list[int]]:  # drafts [B, k'] int64 (k' <= k), and drafts to verify per row
        """Chained greedy drafting. The committed entries are gathered once into a dense [B, C, ...]
        context; the chained entries (depth >= 2) live only in a small dense tail and are never
        written to the pool (the next rebuild writes the real entries at those indices).

        With min_confidence > 0 a row keeps only its leading drafts whose drafter probability is at
        least that, and the chain stops once no row is still confident. That reads the confidences on
        the host after each depth, so it is meant for the CPU, where a read is not a device sync.

        With a guide, each depth's logits are masked by the grammar (the guide reads the previous
        depth's drafts on the host), and a row's count ends at a draft the grammar refuses."""
        if self.native is not None and self.min_confidence == 0:
            drafts = self.native.chain(prev, committed, tables, k, guide)
            return drafts, ([k] * prev.shape[0] if guide is None else list(guide.counts))
        cmax = max(committed)
        tab = tables[:, : -(-cmax // self.block_size)].reshape(-1).long()
        c = device_ints(committed, prev.device)
        drafts, counts = self._chain(prev, c, tab, k, cmax, masked=prev.shape[0] > 1, guide=guide)
        if guide is not None:
            guide.finish(drafts[:, -1], drafts.shape[1])
            counts = [min(a, b) for a, b in zip(counts, guide.counts)]
        return drafts, counts

    @torch.inference_mode()
    def chain_static(
        self,
        source: torch.Tensor,  # [n, d] entry outputs (the last rebuild's)
        rows: list[int],  # [S] each sequence's row of source (its last committed entry)
        committed: list[int],  # [S] C_b, host
        tables: list[list[int]],  # [S] block tables covering [0, C_b)
        k: int,  # drafts per sequence (min_confidence must be 0: no early stop)
        num_rows: int,  # Bp >= S: the batch bucket (padding rows draft garbage, never verified)
        width: int,  # context width, a multiple of block_size and >= every C_b
    ) -> torch.Tensor:  # [Bp, k] drafts, a static tensor (valid until the next call with this shape)
        """`chain` in fixed shapes, a CUDA graph per (Bp, k, width): the contexts padded to `width`
        and masked by their lengths on the device; the host's lists reach the device in one copy."""
        if self.min_confidence > 0:
            raise ValueError("chain_static drafts without a confidence floor")
        key = (num_rows, k, width)
        c, idx, tables = self._stage(key, source, rows, committed, tables, width + k)
        return self.graphs.run(key, lambda: self._static_drafts(self._entries.index_select(0, idx), c, tables, k, width))

    def _stage(self, key: tuple, source: torch.Tensor, rows: list[int], committed: list[int], tables: list[list[int]],
               max_pos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A static chain's inputs from the host's lists, in one copy to key's staging buffer (key:
        (num_rows, k, width)) -> device views (contexts [Bp], source rows [Bp], tables [Bp, nblk]);
        each sequence's last entry is put in _entries when the source is not already there."""
        num_rows, _, width = key
        nblk = width // self.block_size
        st = self._static.get(key)
        if st is None:
            dev = self.k.device
            host = torch.zeros(num_rows * (2 + nblk), dtype=torch.int64, pin_memory=dev.type == "cuda")
            buf = host if dev.type == "cpu" else torch.zeros_like(host, device=dev)
            views = (buf[:num_rows], buf[num_rows:2 * num_rows], buf[2 * num_rows:].view(num_rows, nblk))  # made once
            st = self._static[key] = (host, host.numpy(), buf, views)
        host, np_, buf, views = st
        S = len(rows)
        # the graph reads each sequence's last entry from _entries: a static rebuild left them there
        in_place = source.data_ptr() == self._entries.data_ptr() and source.dtype == self._entries.dtype
        np_[:] = 0  # padding rows: context 0 (they see only their own chained entries) in the scratch block
        np_[:S] = committed
        np_[num_rows:num_rows + S] = rows if in_place else range(S)
        tab = np_[2 * num_rows:].reshape(num_rows, nblk)
        tab[S:, 0] = self.scratch_block
        for i, t in enumerate(tables):
            m = min(len(t), nblk)
            tab[i, :m] = t[:m]
        if buf is not host:
            buf.copy_(host, non_blocking=True)
        if not in_place:  # an eager rebuild's (a prefill step's) outputs
            self._entries[:S].copy_(source[device_ints(rows, source.device)])
        self._grow(max_pos)  # outside a capture
        return views

    @torch.inference_mode()
    def chain_guided(self, source: torch.Tensor, rows: list[int], committed: list[int], tables: list[list[int]],
                     k: int, num_rows: int, width: int, guide: DraftMasks) -> tuple[torch.Tensor, list[int]]:
        """chain_static under a grammar (the fused kernels only): a graph per depth, each draft masked on
        the device by the bitmask the host filled after reading the draft before it (specialists/
        drafter_guided.py) -> drafts [Bp, k] (a static tensor) and the drafts each row may verify."""
        if self.fused is None:
            raise ValueError("chain_guided needs the fused drafter")
        c, idx, tabs = self._stage((num_rows, k, width), source, rows, committed, tables, width + k)
        return guided_chain(self, (num_rows, k, width), c, idx, tabs, len(rows), guide)

    def capture_chain(self, num_rows: int, k: int, width: int) -> bool:
        """Captures chain_static's graph for (num_rows, k, width) on padding rows (context 0, the
        scratch block); False when there are no graphs or it is captured already."""
        if not self.graphs.enabled or self.graphs.has((num_rows, k, width)):
            return False
        source = torch.zeros(1, self.cfg.hidden_size, dtype=self.k.dtype, device=self.k.device)
        self.chain_static(source, [0], [0], [[self.scratch_block]], k, num_rows, width)
        torch.cuda.synchronize()  # the staging buffer is rewritten by the next call
        return True

    def chain_ahead(
        self,
        source: torch.Tensor,  # [Tp, d] a greedy static verify's rebuilt entry outputs (row b*q + j: row b's token j)
        packed: torch.Tensor,  # [Bp, 2q] its greedy acceptance (spec.acceptance.pack: kept count first)
        context: torch.Tensor,  # [Bp] its context lengths (committed + q)
        tables: torch.Tensor,  # [Bp, >= width / block_size] its block tables, reserved through C' + k - 2
        k: int,
        width: int,  # the verify's context width (>= every C')
    ) -> torch.Tensor:  # [Bp, k] drafts for the next step, a static tensor
        """The next step's chain, drafted right after the verify on the device alone: row b keeps a_b
        drafts (packed's first column, spec.acceptance.greedy_accept's count), so it will have committed
        C' = context - q + a_b + 1 tokens and its last entry is source row b*q + a_b. A CUDA graph per
        input set; valid for the next step only if the host then commits exactly those tokens."""
        if self.min_confidence > 0:
            raise ValueError("chain_ahead drafts without a confidence floor")
        Bp, q = packed.shape[0], k + 1
        self._grow(width + k + 1)  # outside a capture
        key = ("ahead", Bp, k, width) + tuple((t.data_ptr(), t.shape[0]) for t in (source, packed, context, tables))

        def chain() -> torch.Tensor:
            kept = packed[:, 0]  # [Bp] drafts kept by the verify's greedy acceptance
            c = torch.where(context > q, context - q + kept + 1, 0)  # padding rows (context q): 0, the scratch block
            prev = source.index_select(0, torch.arange(Bp, device=source.device) * q + kept)
            return self._static_drafts(prev, c, tables, k, width)

        return self.graphs.run(key, chain)

    def capture_guided(self, num_rows: int, k: int, width: int, words: int) -> int:
        """Captures chain_guided's graphs (one per depth) for (num_rows, k, width) on padding rows, for
        grammars over `words` mask words; -> how many (0 without graphs or the fused drafter)."""
        if not self.graphs.enabled or self.fused is None or self.graphs.has(("guided", 0, num_rows, k, width)):
            return 0
        source = torch.zeros(1, self.cfg.hidden_size, dtype=self.k.dtype, device=self.k.device)
        with torch.inference_mode():
            c, idx, tabs = self._stage((num_rows, k, width), source, [0], [0], [[self.scratch_block]], width + k)
            n = capture_guided_chain(self, (num_rows, k, width), c, idx, tabs, words)
        torch.cuda.synchronize()  # the staging buffer is rewritten by the next call
        return n

    def capture_chain_ahead(self, source: torch.Tensor, packed: torch.Tensor, context: torch.Tensor,
                            tables: torch.Tensor, k: int, width: int) -> bool:
        """Captures chain_ahead's graph over a captured verify's outputs (their padding rows: the scratch
        block); False when there are no graphs or it is captured already."""
        if not self.graphs.enabled:
            return False
        n = len(self.graphs)
        self.chain_ahead(source, packed, context, tables, k, width)
        torch.cuda.synchronize()
        return len(self.graphs) > n

    def _static_drafts(self, prev: torch.Tensor, c: torch.Tensor, tables: torch.Tensor, k: int, width: int) -> torch.Tensor:
        """A static chain's drafts [B, k] from prev [B, d], contexts c [B] and tables [B, >= width /
        block_size]: the fused kernels, else `_chain` over the tables' first width positions."""
        if self.fused is not None:
            return self.fused.chain(prev, c, tables, k, width)
        return self._chain(prev, c, tables[:, :width // self.block_size].reshape(-1), k, width, masked=True)[0]

    def _chain(self, prev: torch.Tensor, c: torch.Tensor, tab: torch.Tensor, k: int, width: int,
               masked: bool, guide: DraftMasks | None = None) -> tuple[torch.Tensor, list[int]]:
        """prev [B, d], c [B] contexts, tab [B * width / block_size] their blocks (flat, int64),
        width >= every context -> (drafts [B, k'], drafts to verify per row)."""
        b = prev.shape[0]
        counts = [k] * b
        alive = [True] * b
        first, conf = self._argmax(prev, guide, 0, None)
        drafts = [first]
        if self._stop(conf, 0, counts, alive) or k == 1:
            return torch.stack(drafts, dim=1), counts
        dev = prev.device
        bs, cfg = self.block_size, self.cfg
        nblk = -(-width // bs)
        hkv, hd = cfg.num_key_value_heads, cfg.head_dim
        # one dense [B, width + k - 1] buffer: the committed contexts, then the chained entries
        keys = workspace("chain.k", (b, width + k - 1, hkv, hd), self.k.dtype, self.k.device)
        values = workspace("chain.v", (b, width + k - 1, hkv, hd), self.v.dtype, self.v.device)
        gathered = workspace("chain.gather", (tab.numel(), bs, hkv, hd), self.k.dtype, self.k.device)
        for pool, dst in ((self.k, keys), (self.v, values)):
            dst[:, :width] = torch.index_select(pool, 0, tab, out=gathered).view(b, nblk * bs, hkv, hd)[:, :width]
        span = torch.arange(width + k - 1, device=dev)[None, :]
        # [B, 1, 1, S]: context + tail; one sequence at its own width sees every slot, so it needs none
        mask = ((span < c[:, None]) | (span >= width))[:, None, None, :] if masked else None
        bias = None
        if masked and dev.type == "cuda":  # additive, for grouped_attention: fewer kernels than SDPA's math path
            bias = torch.zeros(mask.shape, dtype=keys.dtype, device=dev).masked_fill_(~mask, float("-inf"))[:, 0]
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        for depth in range(2, k + 1):
            x = self._fuse(prev, drafts[-1])  # [B, d]
            q, kk, vv = self._qkv(x, c + (depth - 1), width + depth)  # entry index C + depth - 2, rope position + 1
            n = width + depth - 1
            keys[:, n - 1] = kk
            values[:, n - 1] = vv
            if bias is not None:
                o = grouped_attention(q[:, None], keys[:, :n], values[:, :n], bias[..., :n], self.scale)[:, 0]
            else:
                o = sdpa(
                    q[:, :, None, :],  # [B, H, 1, hd]
                    keys[:, :n].transpose(1, 2), values[:, :n].transpose(1, 2),
                    attn_mask=None if mask is None else mask[..., :n], scale=self.scale, enable_gqa=groups > 1,
                )[:, :, 0, :]  # [B, H, hd]
            prev = self._finish(x, o)
            token, conf = self._argmax(prev, guide, depth - 1, drafts[-1])
            drafts.append(token)
            if self._stop(conf, depth - 1, counts, alive):
                break
        return torch.stack(drafts, dim=1), counts

    def _stop(self, conf: torch.Tensor | None, j: int, counts: list[int], alive: list[bool]) -> bool:
        """Rows whose draft j is below min_confidence verify j drafts; True when no row is left."""
        if conf is None:
            return False
        for i, p in enumerate(conf.tolist()):
            if alive[i] and p < self.min_confidence:
                alive[i] = False
                counts[i] = j
        return not any(alive)

    def _argmax(self, out: torch.Tensor, guide: DraftMasks | None = None, j: int = 0,
                last: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, d] -> token ids [B], and their drafter probabilities [B] when min_confidence is set; a
        guide masks draft j's logits with the grammar (last: draft j-1, full-vocabulary ids)."""
        logits = self.mm_head(self._unit(out))
        allowed = None if guide is None else guide.for_depth(j, last)
        if allowed is not None:
            free = logits.argmax(-1)
            logits = logits.masked_fill(~allowed, float("-inf"))
        best = logits.argmax(-1)
        if allowed is not None:
            guide.note(j, best, free)
        conf = None
        if self.min_confidence > 0:
            conf = logits.float().softmax(-1).gather(-1, best[:, None])[:, 0]
        return (best if self.vocab is None else self.vocab[best]), conf
