"""The pieces of the fused decode path (specialists/ops/decode_fused.py) against the torch ops they
replace, per layer shape of the named real-size models, on CUDA in bf16, timed as CUDA graphs (what a
decode step replays) over enough copies of each weight that it streams from HBM, not from L2:

  python -m bench.fused_products [--shapes llama-1b smollm2-135m] [--rows 1 4 8] [--sweep] [--results FILE]
                                 [--device cuda|cpu]

One row per (shape, piece, rows): norm (F.rms_norm against the Triton kernel), silu_mul (F.silu(gate)
* up against one kernel), o and down (linear then a residual add, against the GEMM with the residual
as its C operand), and the products through `mma` with their neighbours (qkv and gate_up: RMSNorm +
product; o: product + residual; down: SiLU * up + product + residual, against the torch ops; with the
norms' gains folded into the weights: qkv_folded (the norm's scale only), gate_up_glu (the SwiGLU at its
end) and down_plain (product + residual); the lm_head
and a hybrid's Mamba in_proj / out_proj, plain products, against F.linear; in_proj_norm_mma: the
in_proj under the RMSNorm, tried for a static step's Mamba layer and not kept: slower), with
torch_us, fused_us, max_abs_diff and, for products, weight_mb and the fused side's weight bytes per
second. A side that adds to the residual in place also copies it each call (~2 us). --sweep also
times tile configurations of mma at one and four rows (sweep: [[config, us, us at four rows], ...],
config = (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K)). --device cpu runs the kernels through
Triton's interpreter in fp32 (a check of the script and the kernels' agreement, not a timing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F

from bench.common import device_name, git_commit, graph_us
from bench.shapes import shape_config

EPS = 1e-5
L2_BYTES = 160_000_000  # weights replayed per graph: > 3x an H100's 50 MB L2


def _copies(nbytes: int, dev: str) -> int:
    return 1 if dev == "cpu" else max(2, -(-L2_BYTES // nbytes))


def _dims(cfg) -> tuple[int, int, int, int]:
    """hidden size, ffn size, the attention's width (o's K) and q/k/v's width (its N)."""
    d, heads = cfg.hidden_size, cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or d // heads
    return d, cfg.intermediate_size, heads * hd, (heads + 2 * cfg.num_key_value_heads) * hd


def _pieces(cfg, m: int, dt, dev: str) -> dict:
    """piece -> (torch closures, fused closures, weight bytes or 0): one closure per weight copy."""
    from specialists.ops import decode_fused as D

    d, i, attn, _ = _dims(cfg)
    h = torch.randn(m, d, device=dev, dtype=dt)
    g = torch.rand(d, device=dev, dtype=dt) + 0.5
    gu = torch.randn(m, 2 * i, device=dev, dtype=dt)
    out = {"norm": ([lambda: F.rms_norm(h, (d,), g, EPS)], [lambda: D.rms_norm(h, g, EPS)], 0),
           "silu_mul": ([lambda: F.silu(gu[:, :i]) * gu[:, i:]], [lambda: D.silu_mul(gu)], 0)}
    for name, k in (("o", attn), ("down", i)):
        ws = [torch.randn(d, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(_copies(d * k * 2, dev))]
        x = torch.randn(m, k, device=dev, dtype=dt)
        res = torch.randn(m, d, device=dev, dtype=dt)
        out[name] = ([lambda w=w, x=x, res=res: res + F.linear(x, w) for w in ws],
                     [lambda w=w, x=x, res=res: D.add_product(res.clone(), x, w) for w in ws], d * k * 2)
    out.update(_mma_pieces(cfg, m, dt, dev))
    return out


def _mma_pieces(cfg, m: int, dt, dev: str, config=None) -> dict:
    from specialists.ops import decode_fused as D

    d, i, attn, nq = _dims(cfg)
    h = torch.randn(m, d, device=dev, dtype=dt)
    g = torch.rand(d, device=dev, dtype=dt) + 0.5
    out = {}
    for name, n in (("qkv_mma", nq), ("gate_up_mma", 2 * i)):
        ws = [torch.randn(n, d, device=dev, dtype=dt) / d ** 0.5 for _ in range(_copies(n * d * 2, dev))]
        out[name] = ([lambda w=w: F.linear(F.rms_norm(h, (d,), g, EPS), w) for w in ws],
                     [lambda w=w: D.mma(h, w, gain=g, eps=EPS, config=config) for w in ws], n * d * 2)
    for name, k, swiglu in (("o_mma", attn, False), ("down_mma", i, True)):
        ws = [torch.randn(d, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(_copies(d * k * 2, dev))]
        x = torch.randn(m, 2 * k if swiglu else k, device=dev, dtype=dt)
        a = (lambda x=x, k=k: F.silu(x[:, :k]) * x[:, k:]) if swiglu else (lambda x=x: x)
        out[name] = ([lambda w=w, a=a: h + F.linear(a(), w) for w in ws],
                     [lambda w=w, x=x, swiglu=swiglu: D.mma(x, w, swiglu=swiglu, residual=h.clone(), config=config)
                      for w in ws], d * k * 2)
    out.update(_folded_pieces(cfg, m, dt, dev, config))
    for name, n, k in _plain_products(cfg):  # exact_linear's: no neighbours carried
        ws = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(_copies(n * k * 2, dev))]
        x = torch.randn(m, k, device=dev, dtype=dt)
        out[name] = ([lambda w=w, x=x: F.linear(x, w) for w in ws],
                     [lambda w=w, x=x: D.mma(x, w, config=config) for w in ws], n * k * 2)
        if name == "in_proj_mma":  # the RMSNorm in the product: slower than a norm kernel and the plain product
            out["in_proj_norm_mma"] = ([lambda w=w: F.linear(F.rms_norm(h, (d,), g, EPS), w) for w in ws],
                                       [lambda w=w: D.mma(h, w, gain=g, eps=EPS, config=config) for w in ws], n * k * 2)
    return out


def _folded_pieces(cfg, m: int, dt, dev: str, config=None) -> dict:
    """The products of a model whose norm gains are folded into q/k/v and gate/up (models/llama.py
    fold_norm_gain): q/k/v under the norm (mma kind 3), gate/up with the SwiGLU at its end, the plain down."""
    from specialists.ops import decode_fused as D

    d, i, _, nq = _dims(cfg)
    h = torch.randn(m, d, device=dev, dtype=dt)
    g = torch.rand(d, device=dev, dtype=dt) + 0.5
    out = {}
    for name, n, glu in (("qkv_folded_mma", nq, False), ("gate_up_glu_mma", 2 * i, True)):
        ws = [torch.randn(n, d, device=dev, dtype=dt) / d ** 0.5 for _ in range(_copies(n * d * 2, dev))]
        folded = [(w.float() * g.float()).to(dt) for w in ws]
        act = (lambda y: F.silu(y[:, :n // 2]) * y[:, n // 2:]) if glu else (lambda y: y)
        out[name] = ([lambda w=w, act=act: act(F.linear(F.rms_norm(h, (d,), g, EPS), w)) for w in ws],
                     [lambda w=w, glu=glu: D.mma(h, w, eps=EPS, folded=True, glu=glu, config=config) for w in folded],
                     n * d * 2)
    ws = [torch.randn(d, i, device=dev, dtype=dt) / i ** 0.5 for _ in range(_copies(d * i * 2, dev))]
    a = torch.randn(m, i, device=dev, dtype=dt)
    out["down_plain_mma"] = ([lambda w=w: h + F.linear(a, w) for w in ws],
                             [lambda w=w: D.mma(a, w, residual=h.clone(), config=config) for w in ws], d * i * 2)
    return out


def _plain_products(cfg) -> list[tuple[str, int, int]]:
    """(piece, N, K) of the products `ops.linear.exact_linear` runs on `mma`: the lm_head, and a hybrid's
    Mamba in_proj (z, x, B, C, dt) and out_proj."""
    d = cfg.hidden_size
    out = [("lm_head_mma", cfg.vocab_size, d)]
    if getattr(cfg, "mamba_n_heads", None):
        inner, heads = cfg.mamba_n_heads * cfg.mamba_d_head, cfg.mamba_n_heads
        out += [("in_proj_mma", 2 * inner + 2 * cfg.mamba_n_groups * cfg.mamba_d_state + heads, d),
                ("out_proj_mma", d, inner)]
    return out


def _sweep(cfg, dt, dev: str, only: list[str] | None = None) -> dict[str, list]:
    """piece -> [[config, us at one row, us at four rows], ...] of mma over a grid of configurations."""
    out: dict[str, list] = {}
    for bn, bk, split in itertools.product((16, 32, 64), (128, 256), (1, 2, 4, 8)):
        config = (bn, bk, 4, 3, split)
        one, four = _mma_pieces(cfg, 1, dt, dev, config), _mma_pieces(cfg, 4, dt, dev, config)
        for name in (n for n in one if not only or n in only):
            try:
                out.setdefault(name, []).append([config, round(graph_us(one[name][1], dev), 2),
                                                 round(graph_us(four[name][1], dev), 2)])
            except Exception:  # noqa: BLE001 - a configuration the compiler refuses (shared memory) is skipped
                continue
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["llama-1b", "llama-3b", "smollm2-135m"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--pieces", nargs="+", default=None, help="only these pieces (e.g. in_proj_mma lm_head_mma)")
    p.add_argument("--results", default=None)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args(argv)
    dev = args.device
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--device cpu needs TRITON_INTERPRET=1 in the environment (Triton's interpreter)")
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    commit, device = git_commit(), device_name(dev)
    for shape in args.shapes:
        best = _sweep(shape_config(shape), dt, dev, args.pieces) if args.sweep else {}
        for m in args.rows:
            for name, (torch_path, fused, nbytes) in _pieces(shape_config(shape), m, dt, dev).items():
                if args.pieces and name not in args.pieces:
                    continue
                f_us = graph_us(fused, dev)
                row = {"bench": "fused_products", "shape": shape, "piece": name, "rows": m, "dtype": str(dt)[6:],
                       "torch_us": round(graph_us(torch_path, dev), 2), "fused_us": round(f_us, 2),
                       "max_abs_diff": (torch_path[0]().float() - fused[0]().float()).abs().max().item(),
                       "device_name": device, "commit": commit}
                if nbytes:
                    row.update(weight_mb=round(nbytes / 1e6, 2), fused_tb_s=round(nbytes / f_us / 1e6, 3),
                               weight_copies=len(fused))
                if name in best and m == 1:
                    row["sweep"] = best[name]
                line = json.dumps(row)
                print(line, flush=True)
                if args.results:
                    with open(args.results, "a") as f:
                        f.write(line + "\n")


if __name__ == "__main__":
    main()
