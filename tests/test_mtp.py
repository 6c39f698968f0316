"""The MTP drafter: teacher-forced chains equal chained drafting, masks, loss weights, checkpoints, norms."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specialists.models.mtp import (
    MTP_CONFIG,
    MTP_WEIGHTS,
    MissingDrafterError,
    MTPConfig,
    MTPDrafter,
    chain_mask,
    depth_weights,
    draft_greedy,
    load_drafter,
    save_drafter,
)

D, V, L = 32, 48, 14


def make_drafter(k: int = 3, seed: int = 0, dtype: torch.dtype = torch.float64, std: float = 0.3) -> MTPDrafter:
    torch.manual_seed(seed)
    cfg = MTPConfig(hidden_size=D, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=V, num_speculative_tokens=k)
    drafter = MTPDrafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))  # non-trivial norm weights
            else:
                p.normal_(0.0, std)
    return drafter.to(dtype).eval()


def random_inputs(seed: int = 1, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(L, D, generator=g, dtype=dtype)
    tokens = torch.randint(0, V, (L,), generator=g)
    embed = torch.randn(V, D, generator=g, dtype=dtype)
    head = torch.randn(V, D, generator=g, dtype=dtype)
    return hidden, tokens, embed, head


# ---- chains ----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 5])
def test_forward_chains_equal_chained_drafting(k: int) -> None:
    drafter = make_drafter(k)
    hidden, base_tokens, embed, head = random_inputs()
    distinct_drafts = set()
    for s in range(L - k):  # chain start index s: depth k sits at s+k-1 <= L-2
        drafts = draft_greedy(drafter, hidden[: s + 1], base_tokens[: s + 2], embed, head, k)
        assert drafts.shape == (k,)
        tokens = base_tokens.clone()
        for j in range(k):  # draft j+1 is the token at s+2+j
            if s + 2 + j < L:
                tokens[s + 2 + j] = drafts[j]
        with torch.no_grad():
            outs = drafter.forward_chains(hidden[None], tokens[None], embed, k)
        assert len(outs) == k
        for depth in range(1, k + 1):
            assert outs[depth - 1].shape == (1, L - 1, D)
            logits = drafter.logits(outs[depth - 1][0, s + depth - 1], head)
            assert int(logits.argmax()) == int(drafts[depth - 1]), (s, depth)
        distinct_drafts.update(drafts.tolist())
    assert len(distinct_drafts) > 3  # the drafts are not degenerate, so the check has teeth


def test_forward_chains_depth1_independent_of_later_tokens() -> None:
    """Depth 1 at index t sees only (h_j, x_{j+1}) for j <= t: changing x_{t+2}.. must not change it."""
    drafter = make_drafter(3)
    hidden, tokens, embed, _ = random_inputs()
    t = 5
    other = tokens.clone()
    other[t + 2 :] = (other[t + 2 :] + 7) % V
    with torch.no_grad():
        a = drafter.forward_chains(hidden[None], tokens[None], embed, 3)
        b = drafter.forward_chains(hidden[None], other[None], embed, 3)
    torch.testing.assert_close(a[0][0, : t + 1], b[0][0, : t + 1])
    # depth 2 at index t belongs to the chain started at t-1: it consumes x_{t+1} only
    torch.testing.assert_close(a[1][0, : t + 1], b[1][0, : t + 1])
    assert not torch.allclose(a[0][0, t + 1 :], b[0][0, t + 1 :])


# ---- chain mask ------------------------------------------------------------------------------


def test_chain_mask_depth1_is_causal() -> None:
    m = chain_mask(7, 1, torch.device("cpu"))
    assert m.dtype == torch.bool and m.shape == (7, 7)
    assert torch.equal(m, torch.ones(7, 7, dtype=torch.bool).tril())


def test_chain_mask_depth3_columns() -> None:
    T = 6
    m = chain_mask(T, 3, torch.device("cpu"))
    assert m.shape == (T, 3 * T)
    for t in range(T):
        s = t - 2  # the chain whose depth-3 entry sits at t started at s
        allowed = {j for j in range(T) if j <= s}  # depth-1 entries of committed positions
        allowed |= {T + (s + 1)} if 0 <= s + 1 < T else set()  # its own depth-2 entry at s+1
        allowed |= {2 * T + t}  # itself
        got = {c for c in range(3 * T) if m[t, c]}
        assert got == allowed, (t, sorted(got), sorted(allowed))


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5])
def test_chain_mask_no_empty_row(depth: int) -> None:
    m = chain_mask(9, depth, torch.device("cpu"))
    assert m.shape == (9, 9 * depth)
    assert bool(m.any(dim=1).all())
    assert bool(m[:, (depth - 1) * 9 :].diagonal().all())  # every entry sees itself


# ---- loss weights ----------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_depth_weights_decay_and_sum_to_one(k: int) -> None:
    cfg = make_drafter(k).cfg
    w = depth_weights(cfg, k)
    assert len(w) == k
    assert math.isclose(sum(w), 1.0, rel_tol=1e-9)
    assert all(x > 0 for x in w)
    assert all(a > b for a, b in zip(w, w[1:]))
    if k > 1:
        assert math.isclose(w[1] / w[0], cfg.depth_loss_decay, rel_tol=1e-9)


# ---- checkpoints -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_round_trip(tmp_path, dtype: torch.dtype) -> None:
    drafter = make_drafter(3, dtype=torch.float32)
    save_drafter(drafter, tmp_path / "ckpt", dtype=dtype)
    assert (tmp_path / "ckpt" / MTP_WEIGHTS).is_file() and (tmp_path / "ckpt" / MTP_CONFIG).is_file()
    stored = load_file(str(tmp_path / "ckpt" / MTP_WEIGHTS))
    assert set(stored) == set(drafter.state_dict())
    assert all(t.dtype == dtype for t in stored.values())
    loaded = load_drafter(tmp_path / "ckpt")
    assert loaded.cfg == drafter.cfg
    assert not loaded.training
    for name, p in drafter.state_dict().items():
        q = loaded.state_dict()[name]
        assert q.dtype == torch.float32
        torch.testing.assert_close(q, p.to(dtype).to(torch.float32), rtol=0, atol=0)
    loaded_bf16 = load_drafter(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded_bf16.parameters())


def test_load_is_strict(tmp_path) -> None:
    drafter = make_drafter(3, dtype=torch.float32)
    save_drafter(drafter, tmp_path)
    tensors = load_file(str(tmp_path / MTP_WEIGHTS))
    extra = dict(tensors, **{"block.extra.weight": torch.zeros(2)})
    save_file(extra, str(tmp_path / MTP_WEIGHTS))
    with pytest.raises(RuntimeError):
        load_drafter(tmp_path)
    missing = dict(tensors)
    missing.pop("final_norm.weight")
    save_file(missing, str(tmp_path / MTP_WEIGHTS))
    with pytest.raises(RuntimeError):
        load_drafter(tmp_path)


def test_missing_drafter(tmp_path) -> None:
    with pytest.raises(MissingDrafterError):
        load_drafter(tmp_path)
    assert issubclass(MissingDrafterError, FileNotFoundError)
    # config without weights is still missing
    make_drafter(3, dtype=torch.float32).cfg.save(tmp_path)
    with pytest.raises(MissingDrafterError):
        load_drafter(tmp_path)


# ---- norms -----------------------------------------------------------------------------------


def test_drafter_has_its_norms() -> None:
    drafter = make_drafter(3)
    names = {n for n, _ in drafter.named_modules()}
    for norm in ("hidden_norm", "embed_norm", "final_norm", "block.attn_norm", "block.mlp_norm"):
        assert norm in names
    assert drafter.hidden_norm.weight.shape == (D,)


def test_logits_apply_final_norm() -> None:
    drafter = make_drafter(3)
    g = torch.Generator().manual_seed(3)
    out = torch.randn(5, D, generator=g, dtype=torch.float64) * 3.0
    head = torch.randn(V, D, generator=g, dtype=torch.float64)
    with torch.no_grad():
        logits = drafter.logits(out, head)
        # scale invariant: would be 10x the logits without the final norm
        torch.testing.assert_close(drafter.logits(10.0 * out, head), logits, rtol=1e-5, atol=1e-5)
        w = drafter.final_norm.weight
        expected = F.linear(w * out / out.pow(2).mean(-1, keepdim=True).add(drafter.cfg.rms_norm_eps).sqrt(), head)
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_fuse_normalizes_both_inputs() -> None:
    drafter = make_drafter(3)
    g = torch.Generator().manual_seed(4)
    prev = torch.randn(1, 4, D, generator=g, dtype=torch.float64)
    emb = torch.randn(1, 4, D, generator=g, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(drafter.fuse(7.0 * prev, 3.0 * emb), drafter.fuse(prev, emb), rtol=1e-5, atol=1e-5)
