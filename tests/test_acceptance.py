"""spec.acceptance: greedy tables, seeded determinism, exactness of rejection sampling (chi-square,
with a power check against wrong rules), the typical-acceptance threshold, and no host reads."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spec.acceptance import AcceptanceInputError, TypicalParams, accept, greedy_accept, pack, unpack
from specialists.sampling import SamplingParams, filtered_probs

GREEDY = SamplingParams()
V = 8


def peaked_logits(argmax_rows: list[list[int]], vocab: int = 16) -> torch.Tensor:  # [B, K+1, V]
    """Logits whose argmax at [b, j] is argmax_rows[b][j], with random non-winning entries."""
    gen = torch.Generator().manual_seed(7)
    idx = torch.tensor(argmax_rows)
    noise = torch.rand(*idx.shape, vocab, generator=gen)
    return noise.scatter(-1, idx[..., None], 5.0)


def run_greedy(argmax_rows, drafts, num_drafts, methods=None):
    b = len(drafts)
    return accept(
        peaked_logits(argmax_rows),
        torch.tensor(drafts),
        torch.tensor(num_drafts),
        [GREEDY] * b,
        methods or ["greedy"] * b,
        [None] * b,
    )


# (target argmax at rows 0..K, drafts, num_drafts, expected num_accepted, expected tokens); K = 3
GREEDY_CASES = {
    "all accepted": ([4, 5, 6, 7], [4, 5, 6], 3, 3, [4, 5, 6, 7]),
    "none accepted": ([4, 5, 6, 7], [9, 5, 6], 3, 0, [4, -1, -1, -1]),
    "mismatch in the middle": ([4, 5, 6, 7], [4, 9, 6], 3, 1, [4, 5, -1, -1]),
    "mismatch at the last draft": ([4, 5, 6, 7], [4, 5, 9], 3, 2, [4, 5, 6, -1]),
    "num_drafts < K, garbage past it": ([4, 5, 6, 7], [4, 5, 12345], 2, 2, [4, 5, 6, -1]),
    "num_drafts < K, matching draft past it ignored": ([4, 5, 6, 7], [4, 5, 6], 2, 2, [4, 5, 6, -1]),
    "num_drafts = 0": ([4, 5, 6, 7], [-1, -1, -1], 0, 0, [4, -1, -1, -1]),
    "num_drafts = 0 with matching drafts": ([4, 5, 6, 7], [4, 5, 6], 0, 0, [4, -1, -1, -1]),
}


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_table(case: str) -> None:
    rows, drafts, n, want_n, want_tokens = GREEDY_CASES[case]
    out = run_greedy([rows], [drafts], [n])
    assert out.num_accepted.tolist() == [want_n]
    assert out.tokens.tolist() == [want_tokens]
    assert out.num_accepted.dtype == torch.int64 and out.tokens.dtype == torch.int64


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_accept_and_the_packed_copy(case: str) -> None:
    """The cheap greedy rule (argmax ids only, what the engine's greedy steps and the static graphs
    use) keeps what `accept` keeps, and the packed host copy reads back as each row's run and drafts."""
    rows, drafts, n, want_n, want_tokens = GREEDY_CASES[case]
    argmax, d = torch.tensor([rows]), torch.tensor([drafts])
    got = greedy_accept(argmax, d, torch.tensor([n]))
    assert got.num_accepted.tolist() == [want_n]
    packed = pack(got, d)
    assert packed.shape == (1, 1 + 4 + 3) and packed.dtype == torch.int64
    runs, verified = unpack(packed.tolist(), [n], 3)
    assert runs == [want_tokens[: want_n + 1]] and verified == [drafts[:n]]


def test_one_layout_for_greedy_sampled_and_undrafted_rows() -> None:
    """Greedy and sampled rows of one batch unpack the same way; a step without drafts packs
    [count 0, token] per row."""
    logits = peaked_logits([[4, 5, 6, 7], [1, 2, 3, 4]])
    drafts = torch.tensor([[4, 5, 9], [1, 2, 3]])
    sampled = SamplingParams(temperature=0.7, seed=3)
    gen = torch.Generator().manual_seed(3)
    out = accept(logits, drafts, torch.tensor([3, 2]), [GREEDY, sampled], ["greedy", "rejection"], [None, gen])
    runs, verified = unpack(pack(out, drafts).tolist(), [3, 2], 3)
    for b in range(2):
        a = int(out.num_accepted[b])
        assert runs[b] == out.tokens[b, : a + 1].tolist()
    assert runs[0] == [4, 5, 6] and verified == [[4, 5, 9], [1, 2]]
    plain = greedy_accept(torch.tensor([[8], [3]]), None)
    assert pack(plain, None).tolist() == [[0, 8], [0, 3]]
    assert unpack(pack(plain, None).tolist(), [0, 0], 0) == ([[8], [3]], [[], []])


def test_greedy_table_batched_and_method_independent() -> None:
    """All cases in one batch give the same rows; greedy params ignore the method."""
    cases = list(GREEDY_CASES.values())
    rows = [c[0] for c in cases]
    drafts = [c[1] for c in cases]
    nums = [c[2] for c in cases]
    methods = ["greedy", "rejection", "typical", "greedy", "typical", "rejection", "typical", "greedy"]
    out = run_greedy(rows, drafts, nums, methods)
    assert out.num_accepted.tolist() == [c[3] for c in cases]
    assert out.tokens.tolist() == [c[4] for c in cases]


def test_greedy_rows_untouched_by_sampled_neighbours() -> None:
    """Sampled rows between greedy rows are processed as separate runs; greedy rows stay exact."""
    logits = peaked_logits([[4, 5, 6, 7]] * 4)
    drafts = torch.tensor([[4, 5, 6]] * 4)
    hot = SamplingParams(temperature=1.0)
    out = accept(
        logits, drafts, torch.tensor([3, 3, 3, 1]), [GREEDY, hot, GREEDY, hot],
        ["rejection", "rejection", "typical", "typical"], [None, torch.Generator().manual_seed(1), None, None],
    )
    assert out.tokens[0].tolist() == [4, 5, 6, 7] and out.tokens[2].tolist() == [4, 5, 6, 7]
    assert out.num_accepted[3].item() <= 1 and out.tokens[3, 2:].tolist() == [-1, -1]


def test_zero_speculative_tokens() -> None:
    """K = 0: logits [B, 1, V], drafts [B, 0]; every row emits exactly one token."""
    logits = peaked_logits([[3], [9]])
    out = accept(
        logits, torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long),
        [GREEDY, SamplingParams(temperature=0.01)], ["greedy", "rejection"], [None, torch.Generator().manual_seed(0)],
    )
    assert out.num_accepted.tolist() == [0, 0]
    assert out.tokens.tolist() == [[3], [9]]


def test_bad_inputs_raise_typed_errors() -> None:
    logits = torch.zeros(2, 3, V)
    drafts = torch.zeros(2, 2, dtype=torch.long)
    nd = torch.zeros(2, dtype=torch.long)
    two = [GREEDY, GREEDY]
    with pytest.raises(AcceptanceInputError):
        accept(logits, torch.zeros(2, 3, dtype=torch.long), nd, two, ["greedy"] * 2, [None] * 2)
    with pytest.raises(AcceptanceInputError):
        accept(logits, drafts, nd, [GREEDY], ["greedy"] * 2, [None] * 2)
    with pytest.raises(AcceptanceInputError):
        accept(logits, drafts, nd, two, ["greedy", "eagle"], [None] * 2)  # type: ignore[list-item]
    with pytest.raises(AcceptanceInputError):
        accept(logits, drafts, nd, two, ["greedy"] * 2, [None] * 2, draft_probs=torch.zeros(2, 2, V + 1))


# ---------------------------------------------------------------- seeded determinism


def random_batch(b: int, k: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, k + 1, vocab, generator=gen) * 2  # [B, K+1, V]
    # drafts: half of them the target argmax, so acceptance runs of every length occur
    drafts = torch.where(
        torch.rand(b, k, generator=gen) < 0.5, logits[:, :k].argmax(-1), torch.randint(vocab, (b, k), generator=gen)
    )
    num = torch.randint(k + 1, (b,), generator=gen)
    return logits, drafts, num


@pytest.mark.parametrize("method", ["rejection", "typical"])
def test_seeded_determinism(method: str) -> None:
    b, k, vocab = 96, 4, 32
    logits, drafts, num = random_batch(b, k, vocab, seed=3)
    params = [SamplingParams(temperature=1.3, top_k=20 if i % 2 else 0, top_p=0.9 if i % 3 else 1.0) for i in range(b)]

    def run(seeds: list[int]):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return accept(logits, drafts, num, params, [method] * b, gens, typical=TypicalParams(0.2, 0.5))

    a, again, other = run(list(range(b))), run(list(range(b))), run(list(range(1000, 1000 + b)))
    assert torch.equal(a.tokens, again.tokens) and torch.equal(a.num_accepted, again.num_accepted)
    assert not torch.equal(a.tokens, other.tokens)
    # a row's result depends on its own seed only, not on its neighbours or on how rows are grouped
    for row in range(b):
        alone = accept(
            logits[row : row + 1], drafts[row : row + 1], num[row : row + 1], [params[row]], [method],
            [torch.Generator().manual_seed(row)], typical=TypicalParams(0.2, 0.5),
        )
        assert torch.equal(alone.tokens[0], a.tokens[row])
    # invariants: kept drafts are the drafts, then one token >= 0, then -1
    for i in range(b):
        n = int(a.num_accepted[i])
        assert 0 <= n <= int(num[i])
        assert a.tokens[i, :n].tolist() == drafts[i, :n].tolist()
        assert 0 <= int(a.tokens[i, n]) < vocab
        assert (a.tokens[i, n + 1 :] == -1).all()


# ---------------------------------------------------------------- exactness of rejection sampling

N = 20_000
TARGET = torch.tensor(  # [2, V]; the K = 2 verify rows are TARGET[0], TARGET[1], TARGET[0]
    [[1.2, 0.3, -0.8, 2.0, 0.1, -1.5, 0.9, -0.2], [0.5, 1.5, -0.3, 0.0, 2.2, -1.0, 0.4, 0.8]]
)
FILTERS = {"temperature": (0, 1.0), "top_k": (4, 1.0), "top_p": (0, 0.8)}
Q = torch.tensor([[0.05, 0.05, 0.30, 0.10, 0.05, 0.25, 0.15, 0.05], [0.1, 0.3, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]])  # [2, V]


def target_probs(top_k: int, top_p: float) -> torch.Tensor:  # [3, V] rows 0..K for K = 2
    logits = torch.cat([TARGET, TARGET[:1]])
    return filtered_probs(logits, 0.8, top_k, top_p)


def run_exactness(top_k: int, top_p: float, draft: str, seed: int = 1):
    """N rows, K = 2, the same target; one-hot drafts (a fixed token) or drafts sampled from Q."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.cat([TARGET, TARGET[:1]])[None].expand(N, 3, V).contiguous()
    if draft == "onehot":
        drafts = torch.tensor([[0, 4]]).expand(N, 2).contiguous()
        q = None
    else:
        drafts = torch.stack([torch.multinomial(Q[j], N, replacement=True, generator=gen) for j in range(2)], 1)
        q = Q[None].expand(N, 2, V).contiguous()
    params = [SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)] * N
    out = accept(logits, drafts, torch.full((N,), 2), params, ["rejection"] * N, [gen] * N, draft_probs=q)
    return out, drafts


def chi2_pvalue(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """tokens [n] against probabilities p [V]; tokens outside p's support fail outright."""
    counts = torch.bincount(tokens, minlength=V).double().numpy()
    support = (p > 0).numpy()
    assert counts[~support].sum() == 0, f"tokens outside the support: {counts}"
    expected = p.double().numpy()[support]
    return float(chisquare(counts[support], expected / expected.sum() * counts.sum()).pvalue)


@pytest.mark.parametrize("draft", ["onehot", "sampled"])
@pytest.mark.parametrize("filt", list(FILTERS))
def test_rejection_sampling_is_exact(filt: str, draft: str) -> None:
    top_k, top_p = FILTERS[filt]
    p = target_probs(top_k, top_p)
    out, drafts = run_exactness(top_k, top_p, draft)
    assert chi2_pvalue(out.tokens[:, 0], p[0]) > 1e-3
    # the first draft is kept with probability sum_x min(p(x), q(x)) (one-hot: p(d1))
    q0 = torch.nn.functional.one_hot(torch.tensor(0), V).float() if draft == "onehot" else Q[0]
    beta = torch.minimum(p[0], q0).sum().item()
    rate = (out.num_accepted >= 1).double().mean().item()
    assert abs(rate - beta) < 5 * math.sqrt(beta * (1 - beta) / N)
    if draft == "onehot":  # given d1 kept, the next emitted token follows p at row 1
        kept = out.tokens[:, 0] == 0
        assert chi2_pvalue(out.tokens[kept, 1], p[1]) > 1e-3
        assert (out.tokens[~kept, 1] == -1).all()


@pytest.mark.parametrize("draft", ["onehot", "sampled"])
def test_chi_square_rejects_wrong_rules(draft: str) -> None:
    """Power: the same test rejects 'accept always' and 'on rejection sample from p, not the residual'."""
    p = target_probs(0, 1.0)
    out, drafts = run_exactness(0, 1.0, draft, seed=2)
    assert chi2_pvalue(drafts[:, 0], p[0]) < 1e-6  # accept always: the first token is the draft
    gen = torch.Generator().manual_seed(3)
    plain = accept(  # num_drafts 0: one token sampled from p
        torch.cat([TARGET, TARGET[:1]])[None].expand(N, 3, V), drafts, torch.zeros(N, dtype=torch.long),
        [SamplingParams(temperature=0.8)] * N, ["rejection"] * N, [gen] * N,
    )
    assert chi2_pvalue(plain.tokens[:, 0], p[0]) > 1e-3
    no_residual = torch.where(out.num_accepted >= 1, drafts[:, 0], plain.tokens[:, 0])
    assert chi2_pvalue(no_residual, p[0]) < 1e-6


# ---------------------------------------------------------------- typical acceptance


def typical_one(logits_row: torch.Tensor, draft: int, params: SamplingParams, typical=TypicalParams()) -> int:
    """One row, K = 1, the given draft; returns num_accepted."""
    logits = torch.stack([logits_row, logits_row])[None]  # [1, 2, V]
    out = accept(
        logits, torch.tensor([[draft]]), torch.tensor([1]), [params], ["typical"], [torch.Generator().manual_seed(0)],
        typical=typical,
    )
    return int(out.num_accepted[0])


def test_typical_low_entropy() -> None:
    """Near one-hot target: the argmax draft is kept, a low-probability draft is not; the chain stops at
    the first rejection and the extra token comes from the stop row."""
    logits = peaked_logits([[4, 5, 6]], vocab=16) * 4  # [1, 3, 16], p(argmax) ~ 1
    hot = [SamplingParams(temperature=1.0)]
    run = lambda d: accept(logits, torch.tensor([d]), torch.tensor([2]), hot, ["typical"], [None])  # noqa: E731
    assert run([4, 5]).tokens.tolist() == [[4, 5, 6]]
    assert run([4, 9]).tokens.tolist() == [[4, 5, -1]]
    assert run([9, 5]).tokens.tolist() == [[4, -1, -1]]


def test_typical_epsilon_binds_at_low_entropy() -> None:
    """p = (0.82, 0.10, 0.08, ~0): delta * exp(-H) ~ 0.165 > epsilon, so the threshold is epsilon = 0.09."""
    probs = torch.tensor([0.82, 0.10, 0.08] + [1e-12] * 5)
    logits = probs.log()
    h = -(probs * probs.log()).sum().item()
    assert 0.3 * math.exp(-h) > 0.09
    params = SamplingParams(temperature=1.0)
    assert typical_one(logits, 1, params) == 1
    assert typical_one(logits, 2, params) == 0
    assert typical_one(logits, 2, params, TypicalParams(epsilon=0.07)) == 1


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 1000)])
def test_typical_threshold_at_high_entropy(temperature: float, top_k: int) -> None:
    """Near-uniform target over 4096 tokens with probabilities 0.15% apart: the draft just above
    delta * exp(-H) (H of the filtered p, float64 here) is kept, the one just below is not."""
    vocab = 4096
    logits = torch.linspace(-3.0, 3.0, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(5))]
    z = logits.double().numpy() / temperature
    if top_k:
        z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    nz = p[p > 0]
    h = -(nz * np.log(nz)).sum()
    typical = TypicalParams()
    threshold = min(typical.epsilon, typical.delta * math.exp(-h))
    assert threshold < typical.epsilon  # the entropy term binds
    above = int(np.where(p > threshold, p, np.inf).argmin())
    below = int(np.where((p <= threshold) & (p > 0), p, -np.inf).argmax())
    assert p[above] / p[below] < 1.01
    params = SamplingParams(temperature=temperature, top_k=top_k)
    assert typical_one(logits, above, params) == 1
    assert typical_one(logits, below, params) == 0
    if top_k:  # a token cut by top-k is never kept
        assert typical_one(logits, int(z.argmin()), params) == 0


# ---------------------------------------------------------------- no host reads


def test_accept_reads_no_tensor_values_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Python-level way to read a tensor value (item, tolist, bool, int, float, index, numpy)
    raises inside accept(); on a GPU these would each be a device sync."""
    logits, drafts, num = random_batch(6, 3, 16, seed=11)
    params = [GREEDY, SamplingParams(temperature=0.9), SamplingParams(temperature=0.9, top_p=0.8)] * 2
    methods = ["greedy", "rejection", "typical", "rejection", "rejection", "greedy"]
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    q = torch.softmax(torch.randn(6, 3, 16), -1)

    def forbidden(*_args, **_kwargs):
        raise AssertionError("host read of a tensor value inside accept()")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    out = accept(logits, drafts, num, params, methods, gens, draft_probs=q)
    monkeypatch.undo()
    assert out.tokens.shape == (6, 4) and out.num_accepted.shape == (6,)
