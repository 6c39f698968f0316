"""SSM state slots (conv + SSM state per sequence and Mamba layer), with speculative rollback.

Layout: ``conv`` [num_slots + 1, num_layers, conv_dim, d_conv-1] (conv_dtype) and ``ssm``
[num_slots + 1, num_layers, H, P, N] float32 (the last slot is scratch for padding rows). A sequence owns one slot from ``allocate()`` (zeroed)
to ``free()`` (zeroed again). ``num_layers`` counts Mamba layers only; the caller maps model
layer indices to 0..num_layers-1.

Step protocol:
    prefill:  y, conv, ssm = mamba2_prefill(...);         cache.write(layer, slot, conv, ssm)
    decode (q = 1, every row's one token is always kept): the model writes the new state at once
    verify (q = K+1 tokens, or a batch mixing decodes and verifies):
              y, convs, ssms = mamba2_multi_step(p, u, *cache.read(layer, slots))   # or mamba2_verify
              cache.stage(layer, slots, convs, ssms)      # for every Mamba layer
              ... accept / reject ...
              cache.commit(slots, num_accepted)           # once, after all layers

A static batch (a CUDA graph's, specialists/runner.py) stages every layer at once with
``stage_all(slots, convs [B, q, L, ...], ssms [B, q, L, ...])``, the per-token states stacked over
the layers, so that its commit is one copy per slot for all layers; its forward writes nothing.

``commit`` writes, for every staged layer, the state after exactly ``num_accepted[b]`` of the q
tokens into slot b; ``num_accepted[b] == 0`` leaves the slot as it was (never indexes position
-1: DESIGN lesson 10) and ``num_accepted[b] > q`` is an error. The slot never holds a state
advanced past the accepted position (lesson 8).

Design choice: per-token states (or their factors), not snapshot + replay.
    mamba2_multi_step returns the states after each of the q tokens (closed form: one [q, q]
    decay matrix per head), and we keep them until commit, then copy one. The alternative is to
    snapshot the slot before the verify and, on a partial accept, restore it and re-run the
    accepted tokens through every Mamba layer. With q <= K+1 <= 6 the per-token states cost q
    copies of a small state (shipped cpp model: 8 heads x 64 x 64 fp32 = 128 KiB SSM + 7.5 KiB conv (640 x 3)
    per layer and token), while replay costs a second forward on the common partial-accept path.
    Measured on CPU (torch 2.13, 1 thread of 2 shared cores, the shipped deploy/models/cpp mixer
    of Mamba layer 0, batch 1, 200 interleaved calls; tests/test_mamba2_ops.py::
    test_multi_step_timing prints it, run with -rP):
        mamba2_multi_step q=1: 0.52 ms min / 0.55 ms median
        mamba2_multi_step q=4: 0.79 ms min / 0.83 ms median   (all 4 per-token states included)
        replaying 4 tokens (mamba2_prefill of 4 from the snapshot): 0.84 ms min / 0.88 ms median
    So every intermediate state makes a 4-token verify ~1.5x a 1-token decode, whereas replay
    would add up to another ~0.85 ms per Mamba layer (plus attention/MLP of a re-forward, if done
    through the model) to every partially accepted step -- i.e. roughly double the verify.

    The engine's verifies (q > 1) stage the states' factors instead (mamba2_verify ->
    specialists.ops.mamba2_steps.StateFactors: the state before, the decays, dt*x and B), computing the
    outputs by the quadratic form and only the committed state at commit. Same slot contents
    (tests/test_ssm_cache.py runs both to 1e-6); on the same CPU, 5th-percentile of 300 calls,
    forward plus building one committed state: q=4 0.66 ms against multi_step's 0.79 ms, q=6
    0.76 ms against 1.05 ms. Decodes (q = 1) keep the one state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from state.transfer import device_ints

__all__ = ["SSMCacheConfig", "NoFreeSlotsError", "SSMCache"]


@dataclass
class SSMCacheConfig:
    num_slots: int
    num_layers: int  # number of Mamba layers
    conv_dim: int
    d_conv: int
    num_heads: int
    head_dim: int
    d_state: int
    conv_dtype: torch.dtype = torch.float32
    device: str = "cpu"


_ALL = -1  # the staging key of stage_all: every layer at once


class NoFreeSlotsError(RuntimeError):
    """Every slot is owned by a sequence."""



class SSMCache:
    def __init__(self, config: SSMCacheConfig):
        if config.num_slots <= 0 or config.num_layers <= 0 or config.d_conv < 2:
            raise ValueError(f"bad SSMCacheConfig: {config}")
        self.config = config
        c = config
        # one slot past the pool: scratch, never allocated, read by the padding rows of a bucketed
        # batch (specialists/runner.py); only a padded prefill's padding rows write it (prefill_graph.py)
        self.scratch_slot = c.num_slots
        self.conv = torch.zeros(
            c.num_slots + 1, c.num_layers, c.conv_dim, c.d_conv - 1, dtype=c.conv_dtype, device=c.device
        )
        self.ssm = torch.zeros(
            c.num_slots + 1, c.num_layers, c.num_heads, c.head_dim, c.d_state, dtype=torch.float32, device=c.device
        )
        self._free: list[int] = list(range(c.num_slots))  # kept sorted: lowest slot first
        self._owned: set[int] = set()
        # layer -> (slots [B] long, conv_states [B, q, conv_dim, K-1], ssm_states [B, q, H, P, N])
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._in_slots = False  # write_staged_last put the states after every staged token in the slots
        self._want: dict[int, list[int]] = {}  # slot -> token counts of its next prefill to keep states at
        self._held: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # slot -> layer -> those states

    # -- slots -------------------------------------------------------------------------------------
    def allocate(self) -> int:
        if not self._free:
            raise NoFreeSlotsError(f"all {self.config.num_slots} SSM slots are in use")
        slot = self._free.pop(0)
        self.conv[slot].zero_()
        self.ssm[slot].zero_()
        self._owned.add(slot)
        return slot

    def free(self, slot: int) -> None:
        slot = int(slot)
        if slot not in self._owned:
            raise ValueError(f"slot {slot} is not allocated")
        if any(slot in s.tolist() for s, _, _ in self._staged.values()):
            raise RuntimeError(f"slot {slot} has staged states; commit before freeing it")
        self.conv[slot].zero_()
        self.ssm[slot].zero_()
        self._owned.remove(slot)
        self._free.append(slot)
        self._free.sort()

    def num_free(self) -> int:
        return len(self._free)

    # -- helpers -----------------------------------------------------------------------------------
    def _slots(self, slots, scratch_ok: bool = False) -> torch.Tensor:
        t = torch.as_tensor(slots, dtype=torch.long).reshape(-1).cpu()
        ids = t.tolist()
        if scratch_ok:
            ids = [s for s in ids if s != self.scratch_slot]
        bad = [s for s in ids if s not in self._owned]
        if bad:
            raise ValueError(f"slots {bad} are not allocated")
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate slots {t.tolist()}")
        return t

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.config.num_layers:
            raise IndexError(f"Mamba layer {layer} out of range 0..{self.config.num_layers - 1}")
        return layer

    def read(self, layer: int, slots) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of (conv [B, conv_dim, K-1], ssm [B, H, P, N]) for the given slots (the scratch
        slot may appear, any number of times: padding rows)."""
        idx = self._slots(slots, scratch_ok=True).to(self.conv.device)
        layer = self._layer(layer)
        return self.conv[:, layer].index_select(0, idx), self.ssm[:, layer].index_select(0, idx)

    # -- writes ------------------------------------------------------------------------------------
    def write(self, layer: int, slots, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """Store the states after a prefill: conv_state [B, conv_dim, K-1] and ssm_state
        [B, H, P, N] (or unbatched [conv_dim, K-1] / [H, P, N] with a single slot)."""
        idx = self._slots(slots)
        layer = self._layer(layer)
        c = self.config
        conv_state = conv_state.reshape(idx.numel(), c.conv_dim, c.d_conv - 1)
        ssm_state = ssm_state.reshape(idx.numel(), c.num_heads, c.head_dim, c.d_state)
        idx = idx.to(self.conv.device)
        self.conv[:, layer].index_copy_(0, idx, conv_state.to(self.conv.device, self.conv.dtype))
        self.ssm[:, layer].index_copy_(0, idx, ssm_state.to(self.ssm.device, torch.float32))

    def stage(self, layer: int, slots, conv_states: torch.Tensor, ssm_states) -> None:
        """Hold the per-token states of a multi-step (conv_states [B, q, conv_dim, K-1], and
        ssm_states [B, q, H, P, N] or factors with ``q`` and ``state_after(rows, t)`` that build the
        state after token t on demand, e.g. specialists.ops.mamba2_steps.StateFactors) until ``commit``.
        Nothing is written to the slots yet."""
        idx = self._slots(slots)
        layer = self._layer(layer)
        c = self.config
        B = idx.numel()
        if conv_states.dim() != 4 or tuple(conv_states.shape[:1]) + tuple(conv_states.shape[2:]) != (
            B, c.conv_dim, c.d_conv - 1
        ):
            raise ValueError(f"conv_states {tuple(conv_states.shape)} != [{B}, q, {c.conv_dim}, {c.d_conv - 1}]")
        if isinstance(ssm_states, torch.Tensor):
            if ssm_states.dim() != 5 or tuple(ssm_states.shape[:1]) + tuple(ssm_states.shape[2:]) != (
                B, c.num_heads, c.head_dim, c.d_state
            ):
                want = f"[{B}, q, {c.num_heads}, {c.head_dim}, {c.d_state}]"
                raise ValueError(f"ssm_states {tuple(ssm_states.shape)} != {want}")
            q = ssm_states.shape[1]
        else:
            q = ssm_states.q
        if conv_states.shape[1] != q or q < 1:
            raise ValueError("conv_states and ssm_states disagree on q (or q == 0)")
        if layer in self._staged or _ALL in self._staged:
            raise RuntimeError(f"layer {layer} already has staged states; commit first")
        self._staged[layer] = (idx, conv_states, ssm_states)

    def stage_all(self, slots, conv_states: torch.Tensor, ssm_states: torch.Tensor) -> None:
        """`stage` for every Mamba layer at once, from per-token states stacked over the layers:
        conv_states [B, q, num_layers, conv_dim, K-1], ssm_states [B, q, num_layers, H, P, N] (a static
        batch's, specialists/runner.py). `commit` then writes all layers of a slot in one copy."""
        idx = self._slots(slots)
        c = self.config
        B = idx.numel()
        want_conv = (B, c.num_layers, c.conv_dim, c.d_conv - 1)
        want_ssm = (B, c.num_layers, c.num_heads, c.head_dim, c.d_state)
        if conv_states.dim() != 5 or tuple(conv_states.shape[:1]) + tuple(conv_states.shape[2:]) != want_conv:
            raise ValueError(f"conv_states {tuple(conv_states.shape)} != [{B}, q, {', '.join(map(str, want_conv[1:]))}]")
        if ssm_states.dim() != 6 or tuple(ssm_states.shape[:1]) + tuple(ssm_states.shape[2:]) != want_ssm:
            raise ValueError(f"ssm_states {tuple(ssm_states.shape)} != [{B}, q, {', '.join(map(str, want_ssm[1:]))}]")
        if conv_states.shape[1] != ssm_states.shape[1] or conv_states.shape[1] < 1:
            raise ValueError("conv_states and ssm_states disagree on q (or q == 0)")
        if self._staged:
            raise RuntimeError("layers already have staged states; commit first")
        self._staged[_ALL] = (idx, conv_states, ssm_states)

    def write_staged_last(self) -> None:
        """Writes every staged slot's state after all its staged tokens into the slot, keeping the
        staging for `commit` (which then writes the state after the tokens it keeps): the next step
        decoded ahead (spec/decode_ahead.py) starts from that state before the host has read this step.
        Staged by `stage_all` only (a static step's, every layer at once)."""
        if set(self._staged) != {_ALL}:
            raise RuntimeError("write_staged_last needs one stage_all staging")
        idx, convs, ssms = self._staged[_ALL]
        d = device_ints(idx.tolist(), self.conv.device)
        self.conv[d] = convs[:, -1].to(self.conv.device, self.conv.dtype)
        self.ssm[d] = ssms[:, -1].to(self.ssm.device, torch.float32)
        self._in_slots = True  # commit leaves the rows that keep every staged token (bamba-1b, batch 8: 200 MB a step)

    def staged_layers(self) -> list[int]:
        if _ALL in self._staged:
            return list(range(self.config.num_layers))
        return sorted(self._staged)

    def commit(self, slots, num_accepted) -> None:
        """For every staged layer, write the state after exactly num_accepted[b] tokens into
        slots[b] (0 = leave the slot as it was), then clear the staging. ``slots`` must be the
        staged slots (any order). Checks run on host lists, and the index tensors are built once
        for all layers staged in the same slot order (one decode step: all of them)."""
        ids = self._slots(slots).tolist()
        m = [int(x) for x in (num_accepted.reshape(-1).tolist() if isinstance(num_accepted, torch.Tensor) else num_accepted)]
        if len(m) != len(ids):
            raise ValueError(f"{len(m)} num_accepted for {len(ids)} slots")
        if any(x < 0 for x in m):
            raise ValueError(f"negative num_accepted {m}")
        # Validate everything before writing anything: a failed commit changes no slot.
        # m == 0: untouched, never position -1; all q staged tokens after write_staged_last: in the slot already
        written = self._staged[_ALL][1].shape[1] if self._in_slots else None
        keep = [i for i, x in enumerate(m) if x > 0 and x != written]
        plans = []
        for layer, (sidx, convs, ssms) in self._staged.items():
            staged = sidx.tolist()
            if sorted(staged) != sorted(ids):
                raise ValueError(f"layer {layer} staged slots {staged}, commit got {ids}")
            if any(x > convs.shape[1] for x in m):
                raise ValueError(f"num_accepted {m} exceeds q={convs.shape[1]}")
            row_of = {s: r for r, s in enumerate(staged)}
            plans.append((layer, tuple(row_of[ids[i]] for i in keep), convs, ssms))
        dst = [ids[i] for i in keep]
        pos = [m[i] - 1 for i in keep]
        index: dict[tuple, tuple] = {}  # row order -> (rows, positions, slots) tensors, built once
        for layer, rows, convs, ssms in plans:
            if not rows:
                continue
            if layer == _ALL:  # every layer of a slot in one copy
                layer = slice(None)
            if len(rows) == 1:  # one sequence: plain indexing, no index tensors
                r, p, d = rows[0], pos[0], dst[0]
                self.conv[d, layer] = convs[r, p]
                state = ssms[r, p] if isinstance(ssms, torch.Tensor) else ssms.state_after(slice(r, r + 1), p)[0]
                self.ssm[d, layer] = state
                continue
            if rows not in index:
                dev = convs.device
                index[rows] = (device_ints(rows, dev), device_ints(pos, dev), device_ints(dst, self.conv.device))
            r, p, d = index[rows]
            self.conv[d, layer] = convs[r, p].to(self.conv.device, self.conv.dtype)
            state = ssms[r.to(ssms.device), p.to(ssms.device)] if isinstance(ssms, torch.Tensor) else ssms.state_after(r, p)
            self.ssm[d, layer] = state.to(self.ssm.device, torch.float32)
        self._staged.clear()
        self._in_slots = False

    # -- states inside a step (the prefix cache's snapshots, state/ssm_snapshots.py) ----------------
    def want_prefill_states(self, slot: int, counts: list[int]) -> None:
        """The next forward's prefill of `slot` keeps (`hold`s) its states after each of its first n
        tokens, n in counts (increasing, below the prefill's length)."""
        if counts:
            self._want[int(slot)] = list(counts)

    def prefill_counts(self, slot: int) -> list[int]:
        return self._want.get(int(slot), [])

    def hold(self, layer: int, slot: int, conv_at: torch.Tensor, ssm_at: torch.Tensor) -> None:
        """A prefill's states after prefill_counts(slot): conv_at [n, conv_dim, K-1], ssm_at [n, H, P, N]."""
        self._held.setdefault(int(slot), {})[self._layer(layer)] = (conv_at, ssm_at)

    def state_after(self, slot: int, n: int, last: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [L, conv_dim, K-1], ssm [L, H, P, N]): every Mamba layer's state after the first n
        tokens this step fed `slot`, between the forward and `commit`: a prefill's held states, else the
        staged per-token states; `last` (n is all the step commits of the slot): the slot itself when
        nothing is staged (a prefill's end, or a plain decode that wrote it)."""
        slot, L = int(slot), self.config.num_layers
        held = self._held.get(slot)
        if held is not None and n in self._want.get(slot, []):
            i = self._want[slot].index(n)
            return torch.stack([held[layer][0][i] for layer in range(L)]), torch.stack([held[layer][1][i] for layer in range(L)])
        staged = {k: v for k, v in self._staged.items() if slot in v[0].tolist()}
        if not staged:
            if not last:
                raise ValueError(f"slot {slot}: no state after {n} tokens of this step (neither held nor staged)")
            return self.conv[slot].clone(), self.ssm[slot].clone()
        if _ALL in staged:
            idx, convs, ssms = staged[_ALL]
            r = idx.tolist().index(slot)
            return convs[r, n - 1].clone(), ssms[r, n - 1].clone()
        convs_out, ssms_out = [], []
        for layer in range(L):
            idx, convs, ssms = staged[layer]
            r = idx.tolist().index(slot)
            convs_out.append(convs[r, n - 1])
            ssms_out.append(ssms[r, n - 1] if isinstance(ssms, torch.Tensor) else ssms.state_after(slice(r, r + 1), n - 1)[0])
        return torch.stack(convs_out), torch.stack(ssms_out)

    def release_held(self) -> None:
        """Forget this step's wanted and held prefill states."""
        self._want.clear()
        self._held.clear()

    def discard(self) -> None:
        """Drop the staging without writing (equivalent to commit with all zeros)."""
        self._staged.clear()
        self._in_slots = False
