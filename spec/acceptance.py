"""Acceptance rules for speculative decoding: greedy, rejection sampling (lossless), typical (lossy).

For each sequence b the drafter proposed n_b <= K tokens d_1..d_n; the target ran one forward over
[last committed token, d_1..d_K] and gave logits at K+1 positions (row j predicts the token after
position j). ``accept`` decides how many drafts are kept (0..n_b) and picks exactly one more token
from the target: the correction at the first rejection, or the bonus token after the last kept draft.

Rules per row:

- greedy params (temperature 0), whatever the method: keep d_j while d_j == argmax(row j-1); the
  extra token is the argmax at the stop row. Token for token what non-speculative greedy decoding gives.
- "rejection" (lossless): p = filtered target probs (temperature, top-k, top-p), q = drafter probs
  (one-hot at d_j when the drafts were argmax). Keep d_j with probability min(1, p(d_j)/q(d_j)); at
  the first rejection sample from norm(max(p - q, 0)) (from p if that is all zero); after the last
  kept draft sample the bonus token from p. Each emitted token is distributed exactly as p.
- "typical" (lossy, opt-in, Medusa-style): keep d_j while p(d_j) > min(epsilon, delta * exp(-H(p)))
  with H the entropy (nats) of the filtered p at that row; the extra token is sampled from p at the
  stop row. The output distribution is NOT the target's.
- "greedy" as a method on a sampled row (temperature > 0) behaves as "rejection": exact greedy
  matching has no meaning for sampled tokens, and rejection sampling is the lossless rule.

Randomness: every sampled row draws exactly K+1 uniforms per call from its own generator (K for the
acceptance tests, one for the extra token), whatever happens, so a seeded sequence is reproducible
step by step, whatever its neighbours in the batch. Rows of one group (below) that share one
generator object (or all have none) draw in one call, in row order. Generators must live on the
logits' device. The per-step draws differ from a plain sampler's, so seeded
speculative and non-speculative runs emit different (equally distributed) tokens.

Batching: sampled rows are grouped by (rule, temperature, top_k, top_p), host-side values, and each
group runs as one batch; a group of consecutive rows is a slice, any other an index tensor copied
from pinned memory without blocking. Python loops run over groups (and over rows only to draw from
per-row generators), never over tokens.

No host sync: nothing here reads a tensor value on the host (checked on an H200 under
``torch.cuda.set_sync_debug_mode("error")``). The caller copies ``num_accepted`` and ``tokens`` to
the host once per step.

One owner, one layout: every speculative step (greedy or sampled, eager or static, and the drafter's
chain drafted ahead inside a CUDA graph) decides its kept drafts here. ``greedy_accept`` is the cheap
all-greedy rule (the target's argmax ids compared with the drafts, vectorized: 4 small ops, no
logits work); ``accept`` uses it for its greedy rows. ``pack`` lays a result out as the step's one
device -> host copy, [B, 1 + (K+1) + K]: the kept count, the tokens, the drafts verified; ``unpack``
reads that copy back into each row's run and drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from spec.sampling import SamplingParams, filtered_probs
from state.transfer import device_ints

Method = Literal["greedy", "rejection", "typical"]
_METHODS = frozenset(get_args(Method))


class AcceptanceInputError(ValueError):
    """The inputs of ``accept`` disagree in shape, length or device, or name an unknown method."""


@dataclass(frozen=True)
class TypicalParams:
    epsilon: float = 0.09  # hard ceiling of the acceptance threshold
    delta: float = 0.3  # scale of exp(-entropy)


@dataclass
class AcceptanceResult:
    num_accepted: torch.Tensor  # [B] int64, drafts kept, 0..num_drafts[b]
    # [B, K+1] int64: row b's run is tokens[b, :num_accepted[b] + 1] (kept drafts, then the target's extra
    # token); the entries after it are -1 from `accept`, the target's argmaxes from `greedy_accept`
    tokens: torch.Tensor


def greedy_accept(
    argmax: torch.Tensor,  # [B, K+1] int64, the target's argmax after each fed position
    drafts: torch.Tensor | None,  # [B, K] int64 (None: K = 0, nothing drafted)
    num_drafts: torch.Tensor | None = None,  # [B] int64, 0..K (None: every row verifies K drafts)
) -> AcceptanceResult:
    """Greedy acceptance, exact: keep the leading drafts equal to the target's argmax; the extra
    token is the argmax at the stop row, so the run is the first kept + 1 argmaxes. No host sync."""
    if drafts is None or drafts.shape[1] == 0:
        return AcceptanceResult(argmax.new_zeros(argmax.shape[0]), argmax)
    k = drafts.shape[1]
    keep = drafts == argmax[:, :k]  # [B, K]
    if num_drafts is not None:
        keep &= torch.arange(k, device=drafts.device) < num_drafts[:, None]
    return AcceptanceResult(_kept_prefix(keep), argmax)


def pack(result: AcceptanceResult, drafts: torch.Tensor | None) -> torch.Tensor:
    """-> [B, 1 + (K+1) + K] int64, the step's one host copy: kept count, tokens, drafts (K = 0: none)."""
    parts = [result.num_accepted[:, None], result.tokens]
    if drafts is not None and drafts.shape[1]:
        parts.append(drafts)
    return torch.cat(parts, dim=1)


def pack_runs(tokens: torch.Tensor) -> torch.Tensor:
    """tokens [B, S] of S greedy decodes in a row (specialists/multistep.py) -> `pack`'s layout with
    K = S - 1: every token kept, tokens 1..S-1 as the fed ones (what the KV cache wrote after the first)."""
    B, S = tokens.shape
    kept = torch.full((B, 1), S - 1, dtype=tokens.dtype, device=tokens.device)
    return torch.cat([kept, tokens, tokens[:, : S - 1]], dim=1)


def unpack(host: list[list[int]], num_drafts: list[int], k: int) -> tuple[list[list[int]], list[list[int]]]:
    """`pack`'s rows on the host (K = k) -> (runs, verified drafts) per row: a run is the kept drafts
    and the target's token; row b's drafts are its first num_drafts[b]."""
    runs, drafts = [], []
    for h, n in zip(host, num_drafts):
        runs.append(h[1 : h[0] + 2])
        drafts.append(h[k + 2 : k + 2 + n])
    return runs, drafts


@dataclass(frozen=True)
class _Group:
    """Sampled rows (ascending) that share a rule and filter settings: processed as one batch."""

    rows: tuple[int, ...]
    rule: Literal["rejection", "typical"]
    temperature: float
    top_k: int
    top_p: float


def accept(
    target_logits: torch.Tensor,  # [B, K+1, V] float
    draft_tokens: torch.Tensor,  # [B, K] int64 (entries past num_drafts[b] are ignored)
    num_drafts: torch.Tensor,  # [B] int64 on the same device, 0..K (0 = no speculation this step)
    params: list[SamplingParams],  # [B]
    methods: list[Method],  # [B]
    generators: list[torch.Generator | None],  # [B]
    draft_probs: torch.Tensor | None = None,  # [B, K, V] drafter's filtered probs; None = one-hot q
    typical: TypicalParams = TypicalParams(),
) -> AcceptanceResult:
    """Kept drafts and one extra target token per row (rules in the module docstring); no host sync.

    Raises AcceptanceInputError on inconsistent shapes, lengths, devices or methods."""
    _check_inputs(target_logits, draft_tokens, num_drafts, params, methods, generators, draft_probs)
    k = draft_tokens.shape[1]
    positions = torch.arange(k, device=draft_tokens.device)  # [K]
    valid = positions < num_drafts[:, None]  # [B, K]
    drafts = torch.where(valid, draft_tokens, 0)  # [B, K] ignored entries made safe to gather

    # Greedy for every row (cheap); each group of sampled rows overwrites its rows below.
    argmax = target_logits.argmax(-1)  # [B, K+1]
    num_accepted = greedy_accept(argmax, drafts, num_drafts).num_accepted  # [B]
    extra = argmax.gather(1, num_accepted[:, None]).squeeze(1)  # [B]

    for group in _groups(params, methods):
        rows = _selector(group.rows, target_logits.device)
        n_acc, tok = _accept_sampled(
            _take(target_logits, rows),
            _take(drafts, rows),
            _take(valid, rows),
            None if draft_probs is None else _take(draft_probs, rows),
            group,
            _uniforms([generators[r] for r in group.rows], k + 1, target_logits.device),
            typical,
        )
        _put(num_accepted, rows, n_acc)
        _put(extra, rows, tok)
    return AcceptanceResult(num_accepted=num_accepted, tokens=_assemble(drafts, num_accepted, extra))


def _accept_sampled(
    logits: torch.Tensor,  # [n, K+1, V]
    drafts: torch.Tensor,  # [n, K] in-range token ids (ignored entries zeroed)
    valid: torch.Tensor,  # [n, K] bool, position < num_drafts
    q: torch.Tensor | None,  # [n, K, V] drafter probs, None = one-hot at the drafts
    group: _Group,
    u: torch.Tensor,  # [n, K+1] uniforms in [0, 1)
    typical: TypicalParams,
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [n] int64, extra token [n] int64
    n, k1, v = logits.shape
    k = k1 - 1
    p = filtered_probs(logits.reshape(n * k1, v), group.temperature, group.top_k, group.top_p).view(n, k1, v)
    p_draft = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # [n, K]
    if group.rule == "typical":
        entropy = -torch.special.xlogy(p[:, :k], p[:, :k]).sum(-1)  # [n, K] nats
        threshold = torch.clamp(typical.delta * torch.exp(-entropy), max=typical.epsilon)  # [n, K]
        keep = p_draft > threshold
    elif q is None:
        keep = u[:, :k] < p_draft  # P(keep) = min(1, p(d) / 1)
    else:
        q_draft = q.gather(-1, drafts[..., None]).squeeze(-1).float()  # [n, K]
        keep = u[:, :k] * q_draft < p_draft  # P(keep) = min(1, p(d) / q(d)), no division by 0
    num_accepted = _kept_prefix(keep & valid)  # [n]

    stop = num_accepted[:, None, None].expand(n, 1, v)  # [n, 1, V] row of the extra token
    dist = p.gather(1, stop).squeeze(1)  # [n, V]
    if group.rule == "rejection" and k > 0:  # K = 0: nothing can be rejected, sample from p
        rejected = num_accepted < valid.sum(-1)  # [n] the stop row holds a rejected draft
        at = num_accepted.clamp(max=k - 1)[:, None]  # [n, 1] never past the last draft, never -1
        if q is None:
            residual = dist.scatter(-1, drafts.gather(1, at), 0.0)  # max(p - onehot(d), 0)
        else:
            q_row = q.gather(1, at[:, :, None].expand(n, 1, v)).squeeze(1).float()  # [n, V]
            residual = (dist - q_row).clamp(min=0.0)
        usable = rejected[:, None] & (residual.sum(-1, keepdim=True) > 0)  # [n, 1]
        dist = torch.where(usable, residual, dist)
    return num_accepted, _sample_inverse_cdf(dist, u[:, k])


def _kept_prefix(keep: torch.Tensor) -> torch.Tensor:  # keep: [n, K] bool -> [n] int64
    """Length of the leading run of True in each row."""
    return keep.long().cumprod(-1).sum(-1)


def _sample_inverse_cdf(
    dist: torch.Tensor,  # [n, V] non-negative weights, each row with positive mass
    u: torch.Tensor,  # [n] uniforms in [0, 1)
) -> torch.Tensor:  # [n] int64, token ids with positive weight
    cdf = dist.cumsum(-1)  # [n, V] non-decreasing
    total = cdf[:, -1:]  # [n, 1]
    # Strictly below the total, so the first cdf entry above x exists and has a positive weight.
    x = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(1).clamp(max=dist.shape[1] - 1)


def _assemble(
    drafts: torch.Tensor,  # [B, K]
    num_accepted: torch.Tensor,  # [B]
    extra: torch.Tensor,  # [B]
) -> torch.Tensor:  # [B, K+1]: kept drafts, the extra token, then -1
    b, k = drafts.shape
    padded = torch.cat([drafts, drafts.new_full((b, 1), -1)], dim=1)  # [B, K+1]
    positions = torch.arange(k + 1, device=drafts.device)  # [K+1]
    tokens = torch.where(positions < num_accepted[:, None], padded, -1)
    return tokens.scatter(1, num_accepted[:, None], extra[:, None].to(tokens.dtype))


def _uniforms(
    generators: list[torch.Generator | None],  # [n]
    width: int,
    device: torch.device,
) -> torch.Tensor:  # [n, width] in [0, 1)
    first = generators[0]
    if all(g is first for g in generators):
        return torch.rand(len(generators), width, generator=first, device=device)
    return torch.stack([torch.rand(width, generator=g, device=device) for g in generators])


def _groups(params: list[SamplingParams], methods: list[Method]) -> list[_Group]:
    """Sampled rows grouped by rule and filters, in order of first appearance (greedy rows skipped)."""
    rows: dict[tuple[Literal["rejection", "typical"], float, int, float], list[int]] = {}
    for row, (p, m) in enumerate(zip(params, methods)):
        if not p.greedy:
            rule: Literal["rejection", "typical"] = "typical" if m == "typical" else "rejection"
            rows.setdefault((rule, p.temperature, p.top_k, p.top_p), []).append(row)
    return [_Group(tuple(r), rule, temperature=t, top_k=k, top_p=p) for (rule, t, k, p), r in rows.items()]


Rows = slice | torch.Tensor  # a run of consecutive rows, or row indices [n] int64 on the device


def _selector(rows: tuple[int, ...], device: torch.device) -> Rows:
    """A slice for consecutive rows; otherwise an index tensor, copied without blocking the host."""
    if rows[-1] - rows[0] + 1 == len(rows):
        return slice(rows[0], rows[-1] + 1)
    return device_ints(rows, device)  # on CUDA from pinned memory: the copy is queued, the host does not wait


def _take(t: torch.Tensor, rows: Rows) -> torch.Tensor:  # t: [B, ...] -> [n, ...]
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


def _put(dst: torch.Tensor, rows: Rows, src: torch.Tensor) -> None:  # dst: [B], src: [n]
    if isinstance(rows, slice):
        dst[rows] = src
    else:
        dst.index_copy_(0, rows, src)


def _check_inputs(
    target_logits: torch.Tensor,  # [B, K+1, V]
    draft_tokens: torch.Tensor,  # [B, K]
    num_drafts: torch.Tensor,  # [B]
    params: list[SamplingParams],
    methods: list[Method],
    generators: list[torch.Generator | None],
    draft_probs: torch.Tensor | None,  # [B, K, V]
) -> None:
    """Shapes, lengths and devices only: metadata, never tensor values (no host sync)."""
    if target_logits.dim() != 3 or draft_tokens.dim() != 2 or num_drafts.dim() != 1:
        raise AcceptanceInputError(
            f"expected target_logits [B, K+1, V], draft_tokens [B, K], num_drafts [B]; got "
            f"{tuple(target_logits.shape)}, {tuple(draft_tokens.shape)}, {tuple(num_drafts.shape)}"
        )
    b, k1, v = target_logits.shape
    if draft_tokens.shape != (b, k1 - 1) or num_drafts.shape != (b,):
        raise AcceptanceInputError(
            f"target_logits {tuple(target_logits.shape)} needs draft_tokens {(b, k1 - 1)} and num_drafts "
            f"{(b,)}; got {tuple(draft_tokens.shape)}, {tuple(num_drafts.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (b, k1 - 1, v):
        raise AcceptanceInputError(f"draft_probs must be {(b, k1 - 1, v)}, got {tuple(draft_probs.shape)}")
    if not len(params) == len(methods) == len(generators) == b:
        raise AcceptanceInputError(
            f"batch of {b} rows needs {b} params/methods/generators; got {len(params)}, {len(methods)}, "
            f"{len(generators)}"
        )
    unknown = set(methods) - _METHODS
    if unknown:
        raise AcceptanceInputError(f"unknown acceptance methods {sorted(unknown)}; use one of {sorted(_METHODS)}")
    devices = {t.device for t in (target_logits, draft_tokens, num_drafts)}
    if draft_probs is not None:
        devices.add(draft_probs.device)
    if len(devices) != 1:
        raise AcceptanceInputError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
