"""specialists/ops/mamba2.py against transformers' BambaMixer (the oracle), fp32 on CPU, on random
mixers: two tiny ones, and the two Mamba layers of a random Bamba with the shipped cpp specialist's
shapes (8 heads x 64, d_state 64, SSD chunks of 128; the timing below is quoted in state/ssm_cache.py)."""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time

import pytest
import torch
from transformers import BambaConfig, BambaForCausalLM
from transformers.models.bamba.modeling_bamba import BambaMixer

from specialists.ops.mamba2 import Mamba2Params, mamba2_prefill, segsum
from specialists.ops.mamba2_steps import mamba2_multi_step

TOL = 1e-5
CPP_SHAPES = dict(  # deploy/models/cpp/config.json's shapes, a small vocabulary
    vocab_size=64, hidden_size=256, intermediate_size=384, num_hidden_layers=4, attn_layer_indices=[1, 3],
    num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=64, mamba_expand=2,
    mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4, mamba_chunk_size=128, mamba_conv_bias=True,
    mamba_proj_bias=False, rms_norm_eps=1e-5,
)

# the GPU extra: a CUDA machine without mamba-ssm runs the torch path (these tests compare against it)
NEEDS_MAMBA_SSM = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("mamba_ssm") is None,
                                     reason="mamba-ssm's Triton kernels need a CUDA device and the mamba-ssm GPU extra")


@torch.no_grad()
def _randomize(mixer: BambaMixer, std: float = 0.1) -> BambaMixer:
    """Weights (`std`), biases, decay rates, steps and skip gains spread out (not transformers' tame init)."""
    for lin in (mixer.in_proj, mixer.out_proj):
        torch.nn.init.normal_(lin.weight, std=std)
        if lin.bias is not None:
            torch.nn.init.normal_(lin.bias, std=0.1)
    torch.nn.init.normal_(mixer.conv1d.weight, std=0.3)
    torch.nn.init.normal_(mixer.conv1d.bias, std=0.1)
    heads = mixer.A_log.shape[0]
    mixer.A_log.copy_(torch.log(torch.rand(heads) * 4 + 0.5))
    mixer.D.copy_(torch.randn(heads))
    mixer.dt_bias.copy_(torch.randn(heads) - 2)
    mixer.norm.weight.copy_(1 + 0.1 * torch.randn(mixer.norm.weight.shape[0]))
    return mixer


def _tiny_mixer(seed: int, time_step_limit=(0.0, float("inf"))) -> BambaMixer:
    config = BambaConfig(
        vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=2, attn_layer_indices=[1],
        num_attention_heads=2, num_key_value_heads=1, mamba_n_heads=4, mamba_d_head=32, mamba_expand=2,
        mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=32, mamba_conv_bias=True,
        mamba_proj_bias=True, time_step_limit=time_step_limit, rms_norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    return _randomize(BambaMixer(config, layer_idx=0).float().eval())


@pytest.fixture(scope="module")
def cpp_model() -> BambaForCausalLM:
    """A random Bamba shaped like the shipped cpp specialist (Mamba, attention, Mamba, attention), its
    projections at the trained layers' scale (for unit inputs max |y| is 4 to 5, the trained layers' 2 to 4)."""
    torch.manual_seed(2)
    model = BambaForCausalLM(BambaConfig(**CPP_SHAPES)).float().eval()
    for mixer in _cpp_mixers(model):
        _randomize(mixer, std=0.05)  # the trained cpp layers' projections: std 0.043 to 0.049
    return model


def _cpp_mixers(model) -> list[BambaMixer]:
    attn = set(model.config.attn_layer_indices)
    return [layer.mamba for i, layer in enumerate(model.model.layers) if i not in attn]


@pytest.fixture(scope="module")
def mixers(cpp_model) -> dict[str, BambaMixer]:
    out = {"tiny": _tiny_mixer(0), "tiny_dtlimit": _tiny_mixer(1, (0.01, 0.1))}
    for j, m in enumerate(_cpp_mixers(cpp_model)):
        out[f"cpp_mamba{j}"] = m
    assert len(out) == 4  # the cpp shapes have two Mamba layers
    return out


NAMES = ["tiny", "tiny_dtlimit", "cpp_mamba0", "cpp_mamba1"]


def _hf(mixer: BambaMixer, u: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return mixer(u[None])[0]


def test_segsum_is_the_decay_exponent() -> None:
    a = torch.randn(2, 5)
    s = segsum(a)
    for i in range(5):
        for j in range(5):
            want = a[:, j + 1 : i + 1].sum(-1) if j <= i else torch.full((2,), -float("inf"))
            assert torch.allclose(s[:, i, j], want, atol=1e-6) or (j > i and torch.isinf(s[:, i, j]).all())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("T", [1, 7, 300])
@torch.no_grad()
def test_prefill_matches_transformers(mixers, name: str, T: int) -> None:
    mixer = mixers[name]
    p = Mamba2Params.from_hf(mixer)
    torch.manual_seed(T)
    u = torch.randn(T, p.hidden_size)
    y, conv, ssm = mamba2_prefill(p, u)
    assert y.shape == (T, p.hidden_size) and y.dtype == torch.float32
    assert conv.shape == (p.conv_dim, p.d_conv - 1)
    assert ssm.shape == (p.num_heads, p.head_dim, p.d_state) and ssm.dtype == torch.float32
    assert (y - _hf(mixer, u)).abs().max().item() <= TOL
    assert "mamba_ssm" not in sys.modules  # never imported on CPU


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_prefill_continuation_equals_whole(mixers, name: str) -> None:
    mixer = mixers[name]
    p = Mamba2Params.from_hf(mixer)
    torch.manual_seed(7)
    u = torch.randn(300, p.hidden_size)
    y, conv, ssm = mamba2_prefill(p, u)
    ref = _hf(mixer, u)
    for cut in (1, 2, 7, 129, 299):
        y1, c1, s1 = mamba2_prefill(p, u[:cut])
        y2, c2, s2 = mamba2_prefill(p, u[cut:], c1, s1)
        y12 = torch.cat([y1, y2])
        assert (y12 - y).abs().max().item() <= TOL, cut
        assert (y12 - ref).abs().max().item() <= TOL, cut
        assert (c2 - conv).abs().max().item() <= TOL, cut
        assert (s2 - ssm).abs().max().item() <= TOL, cut
    # a three-token piece continues across a chunk boundary from a mid-chunk state
    _, c1, s1 = mamba2_prefill(p, u[:126])
    y3, _, _ = mamba2_prefill(p, u[126:129], c1, s1)
    assert (y3 - y[126:129]).abs().max().item() <= TOL


def test_from_state_dict_equals_from_hf(cpp_model) -> None:
    sd = cpp_model.state_dict()
    a = Mamba2Params.from_state_dict(sd, cpp_model.config, prefix="model.layers.2.mamba.")
    b = Mamba2Params.from_hf(cpp_model.model.layers[2].mamba)
    u = torch.randn(9, a.hidden_size)
    with torch.no_grad():
        assert torch.equal(mamba2_prefill(a, u)[0], mamba2_prefill(b, u)[0])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("q", [1, 2, 4, 6])
@torch.no_grad()
def test_multi_step_equals_single_steps_and_prefill(mixers, name: str, q: int) -> None:
    p = Mamba2Params.from_hf(mixers[name])
    torch.manual_seed(100 + q)
    prefixes = [1, 5, 40]  # three sequences at different positions, one batch
    seqs = [torch.randn(n + q, p.hidden_size) for n in prefixes]
    conv0, ssm0 = [], []
    for n, s in zip(prefixes, seqs):
        _, c, h = mamba2_prefill(p, s[:n])
        conv0.append(c)
        ssm0.append(h)
    conv0, ssm0 = torch.stack(conv0), torch.stack(ssm0)
    u = torch.stack([s[n:] for n, s in zip(prefixes, seqs)])  # [3, q, d]
    conv_in, ssm_in = conv0.clone(), ssm0.clone()
    y, convs, ssms = mamba2_multi_step(p, u, conv0, ssm0)
    assert torch.equal(conv_in, conv0) and torch.equal(ssm_in, ssm0)  # inputs not modified
    assert y.shape == (3, q, p.hidden_size)
    assert convs.shape == (3, q, p.conv_dim, p.d_conv - 1)
    assert ssms.shape == (3, q, p.num_heads, p.head_dim, p.d_state) and ssms.dtype == torch.float32

    # q successive single steps
    c, h = conv0, ssm0
    for t in range(q):
        yt, cs, hs = mamba2_multi_step(p, u[:, t : t + 1], c, h)
        c, h = cs[:, 0], hs[:, 0]
        assert (yt[:, 0] - y[:, t]).abs().max().item() <= TOL
        assert (c - convs[:, t]).abs().max().item() <= TOL
        assert (h - ssms[:, t]).abs().max().item() <= TOL

    # prefill of the same tokens: outputs, and every per-token state
    for b, (n, s) in enumerate(zip(prefixes, seqs)):
        yp, _, _ = mamba2_prefill(p, s)
        assert (yp[n:] - y[b]).abs().max().item() <= TOL
        for t in range(q):
            _, cp, hp = mamba2_prefill(p, s[: n + t + 1])
            assert (cp - convs[b, t]).abs().max().item() <= TOL
            assert (hp - ssms[b, t]).abs().max().item() <= TOL


@torch.no_grad()
def test_multi_step_matches_transformers_decode(mixers) -> None:
    """q=1 against transformers' own output for the last token of a longer sequence."""
    mixer = mixers["cpp_mamba0"]
    p = Mamba2Params.from_hf(mixer)
    u = torch.randn(20, p.hidden_size)
    _, c, h = mamba2_prefill(p, u[:19])
    y, _, _ = mamba2_multi_step(p, u[None, 19:], c[None], h[None])
    assert (y[0, 0] - _hf(mixer, u)[19]).abs().max().item() <= TOL


@torch.no_grad()
def test_multi_step_timing(cpp_model) -> None:
    """The figure quoted in state/ssm_cache.py's docstring (printed; shown with -rP or -s)."""
    p = Mamba2Params.from_hf(_cpp_mixers(cpp_model)[0])
    torch.manual_seed(0)
    conv = torch.randn(1, p.conv_dim, p.d_conv - 1)
    ssm = torch.randn(1, p.num_heads, p.head_dim, p.d_state)
    inputs = {q: torch.randn(1, q, p.hidden_size) for q in (1, 4)}
    times: dict[str, list[float]] = {"q=1": [], "q=4": [], "replay: prefill of 4": []}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the 2 cores are shared: one thread, interleaved, min and median
    try:
        for rep in range(220):
            for q, u in inputs.items():
                t0 = time.perf_counter()
                mamba2_multi_step(p, u, conv, ssm)
                if rep >= 20:
                    times[f"q={q}"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            mamba2_prefill(p, inputs[4][0], conv[0], ssm[0])
            if rep >= 20:
                times["replay: prefill of 4"].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    med = {k: statistics.median(t) for k, t in times.items()}
    best = {k: min(t) for k, t in times.items()}
    print("mamba2_multi_step, cpp Mamba layer 0, CPU, 1 thread (min / median ms): " + ", ".join(
        f"{k} {best[k] * 1e3:.3f} / {med[k] * 1e3:.3f}" for k in times))
    assert best["q=1"] > 0 and best["q=4"] > 0


@NEEDS_MAMBA_SSM
@pytest.mark.parametrize("T", [7, 300])
@torch.no_grad()
def test_triton_prefill_matches_torch_reference_on_cuda(mixers, T: int) -> None:
    """On CUDA the prefill runs mamba-ssm's Triton chunk scan; the torch reference is the oracle."""
    import copy

    for name, mixer in mixers.items():
        p = Mamba2Params.from_hf(copy.deepcopy(mixer).to("cuda"))  # the fixture's mixers stay on the CPU
        torch.manual_seed(T)
        u = torch.randn(T, p.hidden_size, device="cuda")
        conv0 = torch.randn(p.conv_dim, p.d_conv - 1, device="cuda")
        ssm0 = torch.randn(p.num_heads, p.head_dim, p.d_state, device="cuda")
        ref = mamba2_prefill(p, u, conv0, ssm0, backend="torch")
        got = mamba2_prefill(p, u, conv0, ssm0, backend="triton")
        diffs = [(a - b).abs().max().item() for a, b in zip(got, ref)]
        print(f"{name} T={T}: |triton - torch| y {diffs[0]:.2e} conv {diffs[1]:.2e} ssm {diffs[2]:.2e}")
        assert max(diffs) <= 1e-4, diffs


@NEEDS_MAMBA_SSM
@torch.no_grad()
def test_fused_decode_update_matches_torch_reference_on_cuda(mixers) -> None:
    """A plain decode on CUDA runs mamba-ssm's selective_state_update; the torch step is the oracle
    (outputs, conv state and SSM state after the token; the cache's state is not modified)."""
    import copy

    from specialists.ops.mamba2_steps import mamba2_multi_step

    for name, mixer in mixers.items():
        p = Mamba2Params.from_hf(copy.deepcopy(mixer).to("cuda"))
        torch.manual_seed(1)
        u = torch.randn(3, 1, p.hidden_size, device="cuda")
        conv = torch.randn(3, p.conv_dim, p.d_conv - 1, device="cuda")
        ssm = torch.randn(3, p.num_heads, p.head_dim, p.d_state, device="cuda")
        before = ssm.clone()
        ref = mamba2_multi_step(p, u, conv, ssm, backend="torch")
        got = mamba2_multi_step(p, u, conv, ssm)
        assert torch.equal(ssm, before)
        diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(got, ref)]
        print(f"{name}: |fused - torch| y {diffs[0]:.2e} conv {diffs[1]:.2e} ssm {diffs[2]:.2e}")
        assert max(diffs) <= 1e-4, diffs


@pytest.mark.parametrize("q", [2, 4, 6])
@torch.no_grad()
def test_verify_equals_multi_step(mixers, q: int) -> None:
    """mamba2_verify (quadratic form, state factors) gives multi_step's outputs, and its factors
    give multi_step's per-token states."""
    from specialists.ops.mamba2_steps import mamba2_verify

    for name, mixer in mixers.items():
        p = Mamba2Params.from_hf(mixer)
        torch.manual_seed(q)
        u = torch.randn(3, q, p.hidden_size)
        conv = torch.randn(3, p.conv_dim, p.d_conv - 1)
        ssm = torch.randn(3, p.num_heads, p.head_dim, p.d_state)
        y, convs, states = mamba2_multi_step(p, u, conv, ssm)
        y2, convs2, factors = mamba2_verify(p, u, conv, ssm)
        assert (y2 - y).abs().max().item() <= TOL, name
        assert torch.equal(convs2, convs)
        rows = torch.arange(3).repeat_interleave(q)
        t = torch.arange(q).repeat(3)
        assert (factors.state_after(rows, t) - states[rows, t]).abs().max().item() <= 1e-5, name
