"""Ours against llama.cpp on the same model and prompts, side by side in one run (CPU, batch 1, greedy).

  python -m bench.peers --gguf FILE [--model deploy/models/general] [--prompts bench/data/general/mtbench_first_turns.jsonl]
                        [--limit 8] [--max-new-tokens 64] [--threads 2] [--spec-k 3] [--quantization int8] [--results FILE]

llama.cpp runs through `llama-cpp-python` (the optional extra `peers`: `pip install -e '.[peers]'`,
which builds llama.cpp, minutes) on the GGUF file the checkpoint was imported from; ours runs the
imported checkpoint without and with speculation. Each prompt is rendered in the chat format and
tokenized once (our tokenizer; the GGUF's vocabulary is the same model's), both sides get the same
ids, EOS ignored, `max_new_tokens` greedy tokens. Decode tok/s counts the tokens after the first over
the time after the first one (the prompt's evaluation excluded on both sides; ours takes the prompt
again from its prefix cache and recomputes only its last, partial block inside the timed part).
`same_as_llamacpp`: the fraction of prompts whose tokens equal llama.cpp's; `prefix_agreement_llamacpp`:
the mean fraction of the tokens before the first difference (with `q4` both sides read the file's own
4-bit weights and differ only in how activations are rounded and sums ordered; with int8 ours are a
second rounding of them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.common import device_name, git_commit, read_jsonl, record


def _llamacpp(gguf: Path, threads: int, n_ctx: int):
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise SystemExit("bench.peers needs llama-cpp-python: pip install -e '.[peers]' (it builds llama.cpp)") from exc
    return Llama(model_path=str(gguf), n_threads=threads, n_ctx=n_ctx, logits_all=False, verbose=False)


def _llamacpp_run(llm, ids: list[int], n: int) -> tuple[list[int], float]:
    """Greedy tokens after ids (EOS ignored) and the seconds after the first one."""
    import numpy as np

    llm.reset()
    llm.eval(ids)
    out, t0 = [], None
    vocab = llm.n_vocab()
    for _ in range(n):
        # the last token's logits from the context (llama-cpp-python >= 0.3 no longer copies them into
        # llm.scores unless logits_all; reading scores gave zeros, argmax token 0, before 2026-11-26)
        tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))))
        out.append(tok)
        if t0 is None:
            t0 = time.perf_counter()
        llm.eval([tok])
    return out, time.perf_counter() - t0


def _ours_run(engine, ids: list[int], n: int) -> tuple[list[int], float]:
    from specialists.sampling import SamplingParams

    first = engine.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))[0].token_ids  # the prompt's evaluation
    t0 = time.perf_counter()
    out = engine.generate([ids + first], SamplingParams(max_tokens=n - 1, ignore_eos=True))[0].token_ids
    return first + out, time.perf_counter() - t0


def _prefix(a: list[int], b: list[int]) -> int:
    """How many tokens a and b share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=Path("deploy/models/general"))
    ap.add_argument("--prompts", type=Path, default=Path("bench/data/general/mtbench_first_turns.jsonl"))
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spec-k", type=int, default=3)
    ap.add_argument("--quantization", choices=["none", "int8", "q4", "auto"], default="int8")
    ap.add_argument("--results", type=Path)
    args = ap.parse_args(argv)
    import torch

    from policies.policy import SpeculationPolicy
    from specialists.chat import render
    from specialists.engine import Engine

    torch.set_num_threads(args.threads)
    llm = _llamacpp(args.gguf, args.threads, 2048)
    engines = {name: Engine.from_pretrained(str(args.model), quantization=args.quantization,
                                            policy=SpeculationPolicy(mode=mode, num_speculative_tokens=args.spec_k))
               for name, mode in (("plain", "off"), ("spec", "on"))}
    tok = engines["plain"].tokenizer
    rows = read_jsonl(args.prompts, args.limit)
    prompts = [tok(render([{"role": "user", "content": r["prompt"]}], None, True), add_special_tokens=False)["input_ids"]
               for r in rows]
    n = args.max_new_tokens
    _llamacpp_run(llm, prompts[0], 4)  # warm both
    for e in engines.values():
        e.warmup()
    sides = {"llamacpp": lambda ids: _llamacpp_run(llm, ids, n)}
    sides.update({name: (lambda ids, e=e: _ours_run(e, ids, n)) for name, e in engines.items()})
    tokens = {k: [] for k in sides}
    secs = {k: 0.0 for k in sides}
    for ids in prompts:  # interleaved, so that the machine's drift hits every side alike
        for name, run in sides.items():
            out, dt = run(ids)
            tokens[name].append(out)
            secs[name] += dt
    tps = {k: round(len(prompts) * (n - 1) / secs[k], 2) for k in sides}
    same = lambda a, b: round(sum(x == y for x, y in zip(tokens[a], tokens[b])) / len(prompts), 4)  # noqa: E731
    row = {"bench": "peers", "device": device_name("cpu"), "commit": git_commit(), "model": str(args.model),
           "gguf": args.gguf.name, "threads": args.threads, "prompts": len(prompts), "max_new_tokens": n,
           "quantization": engines["plain"].cfg.quantization, "spec_k": args.spec_k, "llamacpp_tok_s": tps["llamacpp"],
           "plain_tok_s": tps["plain"], "spec_tok_s": tps["spec"],
           "plain_over_llamacpp": round(tps["plain"] / tps["llamacpp"], 3),
           "spec_over_llamacpp": round(tps["spec"] / tps["llamacpp"], 3),
           "identical_spec": same("spec", "plain"), "same_as_llamacpp": same("plain", "llamacpp"),
           "prefix_agreement_llamacpp": round(sum(_prefix(a, b) for a, b in zip(tokens["plain"], tokens["llamacpp"]))
                                              / (len(prompts) * n), 4)}
    record(args.results, row)
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
