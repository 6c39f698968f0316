"""state/ssm_cache.py: stage + commit leaves exactly the state of a fresh prefill of the committed
tokens (DESIGN lessons 8 and 10), on the two Mamba layers of a tiny random Bamba (states of the same
size as the shipped cpp model's; prompts that cross an SSD chunk), fp32 on CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, BambaConfig

from specialists.ops.mamba2 import Mamba2Params, mamba2_prefill
from specialists.ops.mamba2_steps import mamba2_multi_step, mamba2_verify
from state.ssm_cache import NoFreeSlotsError, SSMCache, SSMCacheConfig

TOL = 1e-6  # the issue: "a committed SSM slot equals a fresh prefill of the same tokens to 1e-6 (fp32)"


@pytest.fixture(scope="module")
def params() -> list[Mamba2Params]:
    """Mamba, attention, Mamba: random weights (std 0.1), SSD chunks of 32 tokens."""
    torch.manual_seed(0)
    config = BambaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         attn_layer_indices=[1], num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4,
                         mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=32,
                         mamba_d_conv=4, initializer_range=0.1)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    attn = set(model.config.attn_layer_indices)
    return [Mamba2Params.from_hf(l.mamba) for i, l in enumerate(model.model.layers) if i not in attn]


def _cache(params, num_slots: int = 8) -> SSMCache:
    p = params[0]
    return SSMCache(SSMCacheConfig(
        num_slots=num_slots, num_layers=len(params), conv_dim=p.conv_dim, d_conv=p.d_conv,
        num_heads=p.num_heads, head_dim=p.head_dim, d_state=p.d_state,
    ))


def _prefill_into(cache: SSMCache, params, slot: int, inputs: list[torch.Tensor]) -> None:
    for layer, (p, u) in enumerate(zip(params, inputs)):
        _, c, h = mamba2_prefill(p, u)
        cache.write(layer, slot, c, h)


@torch.no_grad()
def _verify_step(cache: SSMCache, params, slots: list[int], u: list[torch.Tensor], step=mamba2_multi_step) -> None:
    """One multi-step of q tokens for every slot, in every Mamba layer, staged (per-token states from
    mamba2_multi_step, or state factors from mamba2_verify, which the engine uses for q > 1)."""
    for layer, p in enumerate(params):
        conv, ssm = cache.read(layer, slots)
        _, convs, ssms = step(p, u[layer], conv, ssm)
        cache.stage(layer, slots, convs, ssms)


@pytest.mark.parametrize("step", [mamba2_multi_step, mamba2_verify], ids=["states", "factors"])
@pytest.mark.parametrize("q", [1, 4, 6])
@torch.no_grad()
def test_commit_equals_fresh_prefill_of_committed_tokens(params, q: int, step) -> None:
    """A batch of q+1 sequences at different lengths commits m = 0..q, one m each: every slot
    ends exactly where a fresh prefill of its committed tokens ends, the others don't move."""
    torch.manual_seed(q)
    cache = _cache(params)
    d = params[0].hidden_size
    B = q + 1
    prefix_len = [3 + 5 * b for b in range(B)]
    # per sequence, per layer: the layer's input for prefix + q proposed tokens
    seqs = [[torch.randn(n + q, d) for _ in params] for n in prefix_len]
    bystander = cache.allocate()
    _prefill_into(cache, params, bystander, [torch.randn(11, d) for _ in params])
    by_conv, by_ssm = cache.conv[bystander].clone(), cache.ssm[bystander].clone()
    slots = [cache.allocate() for _ in range(B)]
    for slot, n, s in zip(slots, prefix_len, seqs):
        _prefill_into(cache, params, slot, [x[:n] for x in s])
    before_conv, before_ssm = cache.conv.clone(), cache.ssm.clone()

    u = [torch.stack([s[layer][n:] for n, s in zip(prefix_len, seqs)]) for layer in range(len(params))]
    _verify_step(cache, params, slots, u, step)
    assert torch.equal(cache.conv, before_conv) and torch.equal(cache.ssm, before_ssm)  # staged only
    accepted = list(range(B))  # sequence b accepts b tokens, 0..q
    perm = list(reversed(range(B)))  # commit may list the slots in another order
    cache.commit([slots[i] for i in perm], [accepted[i] for i in perm])
    assert cache.staged_layers() == []

    for b, (slot, n, s) in enumerate(zip(slots, prefix_len, seqs)):
        m = accepted[b]
        for layer, p in enumerate(params):
            _, c, h = mamba2_prefill(p, s[layer][: n + m])
            assert (cache.conv[slot, layer] - c).abs().max().item() <= TOL, (b, layer)
            assert (cache.ssm[slot, layer] - h).abs().max().item() <= TOL, (b, layer)
        if m == 0:  # untouched, bit for bit
            assert torch.equal(cache.conv[slot], before_conv[slot])
            assert torch.equal(cache.ssm[slot], before_ssm[slot])
    assert torch.equal(cache.conv[bystander], by_conv) and torch.equal(cache.ssm[bystander], by_ssm)


@pytest.mark.parametrize("step", [mamba2_multi_step, mamba2_verify], ids=["states", "factors"])
@torch.no_grad()
def test_each_m_alone_and_repeated_steps(params, step) -> None:
    """Uniform num_accepted = m for m in 0..q, then a second step from the committed state."""
    q = 4
    d = params[0].hidden_size
    torch.manual_seed(11)
    s = [torch.randn(10 + 2 * q, d) for _ in params]
    for m in range(q + 1):
        cache = _cache(params, num_slots=2)
        slot = cache.allocate()
        _prefill_into(cache, params, slot, [x[:10] for x in s])
        _verify_step(cache, params, [slot], [x[None, 10 : 10 + q] for x in s], step)
        cache.commit([slot], torch.tensor([m]))
        n = 10 + m
        _verify_step(cache, params, [slot], [x[None, n : n + q] for x in s], step)
        cache.commit(torch.tensor([slot]), [q])
        for layer, p in enumerate(params):
            _, c, h = mamba2_prefill(p, s[layer][: n + q])
            assert (cache.conv[slot, layer] - c).abs().max().item() <= TOL, m
            assert (cache.ssm[slot, layer] - h).abs().max().item() <= TOL, m


def test_allocate_and_free_zero_the_slot(params) -> None:
    cache = _cache(params, num_slots=2)
    a, b = cache.allocate(), cache.allocate()
    assert {a, b} == {0, 1} and cache.num_free() == 0
    with pytest.raises(NoFreeSlotsError):
        cache.allocate()
    cache.conv[a] = 1.0
    cache.ssm[a] = 2.0
    cache.ssm[b] = 3.0
    cache.free(a)
    assert cache.num_free() == 1
    assert not cache.conv[a].any() and not cache.ssm[a].any()
    assert (cache.ssm[b] == 3.0).all()  # the neighbour is left alone
    cache.conv[a] = 5.0  # even a stray write is cleared on allocate
    assert cache.allocate() == a
    assert not cache.conv[a].any() and not cache.ssm[a].any()
    with pytest.raises(ValueError):
        cache.free(7)
    cache.free(b)
    with pytest.raises(ValueError):
        cache.free(b)  # double free


@torch.no_grad()
def test_bad_commits_change_nothing(params) -> None:
    cache = _cache(params, num_slots=4)
    p = params[0]
    slots = [cache.allocate(), cache.allocate()]
    q = 3
    convs = torch.randn(2, q, p.conv_dim, p.d_conv - 1)
    ssms = torch.randn(2, q, p.num_heads, p.head_dim, p.d_state)
    for layer in range(len(params)):
        cache.stage(layer, slots, convs, ssms)
    with pytest.raises(RuntimeError):
        cache.stage(0, slots, convs, ssms)  # already staged
    with pytest.raises(RuntimeError):
        cache.free(slots[0])  # staged
    snapshot = (cache.conv.clone(), cache.ssm.clone())
    with pytest.raises(ValueError):
        cache.commit(slots, [1, q + 1])  # more than q accepted
    with pytest.raises(ValueError):
        cache.commit(slots, [1, -1])
    with pytest.raises(ValueError):
        cache.commit(slots[:1], [1])  # not the staged slots
    assert torch.equal(cache.conv, snapshot[0]) and torch.equal(cache.ssm, snapshot[1])
    cache.commit(slots, [0, q])
    assert torch.equal(cache.conv[slots[0]], snapshot[0][slots[0]])
    for layer in range(len(params)):
        assert torch.equal(cache.conv[slots[1], layer], convs[1, q - 1])
        assert torch.equal(cache.ssm[slots[1], layer], ssms[1, q - 1])
    with pytest.raises(ValueError):
        cache.stage(0, slots, convs[:, :, :-1], ssms)  # wrong conv shape
    with pytest.raises(ValueError):
        cache.stage(0, [3], convs[:1], ssms[:1])  # slot 3 not allocated


def test_write_staged_last_writes_the_last_states_and_commit_still_keeps_fewer(params) -> None:
    """Before a step decoded ahead launches (spec/decode_ahead.py) the state after all staged tokens
    goes into each slot, the staging kept; the step's commit then writes the state after the tokens it
    keeps (fewer for a run cut short): the slots end as a commit alone leaves them."""
    torch.manual_seed(3)
    cache, alone = _cache(params), _cache(params)
    slots = [cache.allocate() for _ in range(3)]
    assert [alone.allocate() for _ in range(3)] == slots
    c = cache.config
    conv = torch.randn(3, 4, c.num_layers, c.conv_dim, c.d_conv - 1)
    ssm = torch.randn(3, 4, c.num_layers, c.num_heads, c.head_dim, c.d_state)
    with pytest.raises(RuntimeError):
        cache.write_staged_last()  # nothing staged
    cache.stage_all(slots, conv, ssm)
    cache.write_staged_last()
    for b, s in enumerate(slots):
        assert torch.equal(cache.conv[s], conv[b, -1]) and torch.equal(cache.ssm[s], ssm[b, -1])
    cache.commit(slots, [4, 2, 1])
    alone.stage_all(slots, conv, ssm)
    alone.commit(slots, [4, 2, 1])
    assert torch.equal(cache.conv, alone.conv) and torch.equal(cache.ssm, alone.ssm)
    assert torch.equal(cache.ssm[slots[1]], ssm[1, 1]) and cache.staged_layers() == []


def test_a_commit_after_write_staged_last_writes_only_the_rows_cut_short(params) -> None:
    """A row that keeps every staged token already has that state in its slot (write_staged_last): the
    commit leaves it (bamba-1b at batch 8 copied 200 MB a step twice); a row cut short still gets the
    state after its kept tokens. Shown by changing the staging after write_staged_last: only the cut row
    takes the change. A later staging is committed in full again."""
    torch.manual_seed(4)
    cache = _cache(params)
    slots = [cache.allocate() for _ in range(2)]
    c = cache.config
    conv = torch.randn(2, 4, c.num_layers, c.conv_dim, c.d_conv - 1)
    ssm = torch.randn(2, 4, c.num_layers, c.num_heads, c.head_dim, c.d_state)
    cache.stage_all(slots, conv, ssm)
    cache.write_staged_last()
    last = ssm[0, -1].clone()
    ssm.zero_()
    conv.zero_()
    cache.commit(slots, [4, 2])
    assert torch.equal(cache.ssm[slots[0]], last) and not cache.ssm[slots[0]].eq(0).all()
    assert cache.ssm[slots[1]].eq(0).all() and cache.conv[slots[1]].eq(0).all()
    cache.stage_all(slots, conv + 1, ssm + 1)
    cache.commit(slots, [4, 4])  # no write_staged_last: every kept row written
    assert cache.ssm[slots[0]].eq(1).all() and cache.ssm[slots[1]].eq(1).all()
