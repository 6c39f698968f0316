"""Tool calls and structured output under constrained decoding, on held-out function schemas.

    python -m bench.tool_validity [--model DIR ...] [--data bench/data/tools/bfcl_heldout.jsonl]
                                  [--mode tool_required|response_format] [--grammar on|off]
                                  [--limit N] [--max-tokens 256] [--results FILE]

Each row of the data (BFCL held-out functions and a user question; bench/data/tools/README.md) goes
through the router's own code, in process: `plan_tools` (tool_choice "required") or `response_grammar`
(response_format json_schema with the first function's parameters), the chat template, the engine
with the specialist's drafter and default policy, greedy. A reply counts as valid when:

* tool_required: its first call names an offered function and its arguments parse and validate
  against that function's (repaired) schema (specialists/chat.validate_arguments);
* response_format: the reply parses as JSON and validates against the schema.

`--grammar off` runs the same prompts without the grammar (the forced `<tool_call>` prefix stays):
what the model does on its own. One JSON line per specialist on stdout (and appended to --results):
valid rate, finish reasons, tokens, masked drafts and mask time, the checkpoint, device and commit.

`--speed` measures what the grammar costs speculation instead, at batch 1 (one request at a time,
greedy, until the end of turn or --max-tokens): the same prompts with the grammar and without it, each
through the engine with its drafter (policy on, or --policy auto; K from --spec-k) and without
speculation, timed in one run, interleaved request by request (--repeat R rounds): speedup_free and
speedup_grammar (speculative over plain tok/s), their ratio (also per round), identical outputs,
acceptance, the grammar's mask time per step, and each way's ms per step with the step's draft,
verify and commit parts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import DTYPES, checkpoint_id, device_name, git_commit, read_jsonl, record
from router.api import ChatCompletionRequest
from router.limits import RequestLimits
from router.tools import ToolPlan, extract_tool_calls, plan_tools, response_grammar, to_template_messages
from specialists.chat import render, validate_arguments
from specialists.engine import Engine
from specialists.sampling import SamplingParams
from specialists.wire import GrammarSpec

log = logging.getLogger("bench.tool_validity")
DATA = Path("bench/data/tools/bfcl_heldout.jsonl")
DEFAULT_MODELS = ["deploy/models/cpp", "deploy/models/python", "deploy/models/build", "deploy/models/shell",
                  "deploy/models/general"]


def requests_of(rows: list[dict], mode: str) -> list[ChatCompletionRequest]:
    out = []
    for row in rows:
        tools = [{"type": "function", "function": f} for f in row["functions"]]
        body: dict[str, Any] = {"model": "auto", "messages": row["messages"]}
        if mode == "tool_required":
            body.update(tools=tools, tool_choice="required")
        else:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema_of(row)}}
        out.append(ChatCompletionRequest.model_validate(body))
    return out


def schema_of(row: dict) -> dict:
    """The response_format schema of a row: its first function's parameters, repaired as for a tool."""
    from router.tools import parameters_of

    return parameters_of(row["functions"][0].get("parameters"))


def prepare(reqs: list[ChatCompletionRequest], mode: str) -> tuple[list[ToolPlan], list[str], list[GrammarSpec | None]]:
    """Each request as the router serves it: its tool plan, its rendered prompt, its grammar."""
    limits = RequestLimits()
    plans = [plan_tools(req) for req in reqs]
    prompts = [render(to_template_messages(req.messages), plan.prompt_tools, True) + plan.forced_prefix
               for req, plan in zip(reqs, plans)]
    specs = [plan.grammar if mode == "tool_required" else response_grammar(req, limits) for req, plan in zip(reqs, plans)]
    return plans, prompts, specs


def check_reply(req: ChatCompletionRequest, plan: ToolPlan, text: str, mode: str) -> tuple[bool, str]:
    """(valid, why not) of one reply (text: the forced prefix, then what the model wrote)."""
    if mode == "tool_required":
        got = extract_tool_calls(text, plan)
        if not got.calls:
            return False, "no call" if not got.errors else got.errors[0].error
        call = got.calls[0]
        schema = plan.schemas.get(call.function.name)
        if schema is None:
            return False, f"name {call.function.name!r} not offered"
        try:
            args = json.loads(call.function.arguments)
        except ValueError:
            return False, "arguments are not JSON"
        err = validate_arguments(args, schema)
        return err is None, err or ""
    try:
        value = json.loads(text)
    except ValueError:
        return False, "not JSON"
    err = validate_arguments(value, req.response_format["json_schema"]["schema"])
    return err is None, err or ""


def evaluate(model_dir: str, rows: list[dict], mode: str, grammar: bool, max_tokens: int, device: str = "cpu") -> dict[str, Any]:
    engine = Engine.from_pretrained(model_dir, device=device)
    reqs = requests_of(rows, mode)
    plans, prompts, specs = prepare(reqs, mode)
    t0 = time.perf_counter()
    params = [SamplingParams(max_tokens=max_tokens, grammar=engine.grammar(spec) if grammar else None) for spec in specs]
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=True)
    gen_s = time.perf_counter() - t0
    valid, reasons, failures = 0, Counter(), []
    for row, req, plan, out in zip(rows, reqs, plans, outs):
        ok, why = check_reply(req, plan, plan.forced_prefix + out.text, mode)
        valid += ok
        reasons[out.finish_reason] += 1
        if not ok:
            failures.append({"id": row["id"], "why": why[:200], "text": out.text[:200]})
    m = engine.metrics()
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "bench": "tool_validity", "mode": mode, "grammar": grammar, "specialist": Path(model_dir).name,
        **checkpoint_id(Path(model_dir)), "device": device_name(str(engine.device)), "commit": git_commit(),
        "requests": len(rows), "valid": valid, "valid_rate": round(valid / max(1, len(rows)), 4),
        "finish_reasons": dict(reasons), "tokens": tokens, "generate_s": round(gen_s, 2), "compile_s": round(compile_s, 3),
        "drafted": m["drafted"], "accepted": m["accepted"], "grammar_drafts": m["grammar_drafts"],
        "grammar_masked_drafts": m["grammar_masked_drafts"], "grammar_mask_s": round(m["grammar_mask_s"], 4),
        "grammar_steps": m["grammar_steps"], "failures": failures[:5],
    }


COUNTS = ("steps", "drafted", "accepted", "grammar_steps", "grammar_mask_s", "grammar_masked_drafts", "grammar_drafts",
          "draft_s", "verify_s", "commit_s")


def speed(model_dir: str, rows: list[dict], mode: str, max_tokens: int, k: int, device: str = "cpu",
          repeat: int = 1, policy: str = "on", dtype: str = "float32") -> dict[str, Any]:
    """Speculation's speed-up with the grammar and without it, batch 1, on the same prompts.

    Interleaved: each request runs in its four ways (speculative and plain, with the grammar and
    without) one after the other, in an order that rotates from request to request and round to
    round, so that a drift of the machine's speed (a GPU's host-bound toys swung the ratio by up to
    0.42 between two runs timed phase after phase) hits the four alike."""
    from policies.policy import SpeculationPolicy

    # no prefix cache: a round's prefills must repeat the first's (in half precision a prefill over a cached
    # prefix runs other products than the whole prompt's, and a near-tie may then go another way)
    opts = {"device": device, "dtype": DTYPES[dtype], "enable_prefix_cache": False}
    engines = {"spec": Engine.from_pretrained(model_dir, **opts, policy=SpeculationPolicy(mode=policy, num_speculative_tokens=k)),
               "plain": Engine.from_pretrained(model_dir, **opts, policy=SpeculationPolicy(mode="off"))}
    for eng in engines.values():
        eng.warmup()
    _, prompts, specs = prepare(requests_of(rows, mode), mode)
    ways = [(name, grammar) for grammar in (False, True) for name in engines]
    tag = lambda name, grammar: f"{name}_{'grammar' if grammar else 'free'}"  # noqa: E731
    for name, grammar in ways:  # each way's first call (a grammar's first compile, a new shape) before timing
        eng = engines[name]
        eng.generate([prompts[0]], SamplingParams(max_tokens=8, grammar=eng.grammar(specs[0]) if grammar else None))
    secs = {tag(*w): [0.0] * repeat for w in ways}
    sums = {tag(*w): dict.fromkeys(COUNTS, 0.0) for w in ways}
    tokens: dict[str, list[list[int]]] = {tag(*w): [] for w in ways}
    n_tok = dict.fromkeys(secs, 0)
    for r in range(repeat):
        for i, (prompt, spec) in enumerate(zip(prompts, specs)):
            turn = (i + r) % len(ways)
            for name, grammar in ways[turn:] + ways[:turn]:
                eng, key = engines[name], tag(name, grammar)
                params = SamplingParams(max_tokens=max_tokens, grammar=eng.grammar(spec) if grammar else None)
                before = eng.metrics()
                t0 = time.perf_counter()
                o = eng.generate([prompt], params)[0]
                secs[key][r] += time.perf_counter() - t0
                after = eng.metrics()
                for c in COUNTS:
                    sums[key][c] += after[c] - before[c]
                n_tok[key] += len(o.token_ids)
                if r == 0:
                    tokens[key].append(o.token_ids)
                elif o.token_ids != tokens[key][i]:
                    raise RuntimeError(f"{key}: request {i} gave other tokens in round {r + 1} than in round 1")
    out = _figures(secs, sums, n_tok, repeat)
    ratio = lambda r=None: (_speedup(secs, "grammar", r) / _speedup(secs, "free", r))  # noqa: E731
    free, constrained = _speedup(secs, "free"), _speedup(secs, "grammar")
    same = lambda a, b: sum(x == y for x, y in zip(tokens[a], tokens[b])) / len(prompts)  # noqa: E731
    gate = engines["spec"].gate.snapshot()  # under auto: what it judged per bucket, free and guided
    return {"bench": "grammar_speed", "mode": mode, "k": k, "policy": policy, "dtype": dtype,
            **({"measured_speedup": gate["measured_speedup"], "slow_buckets": gate["slow_buckets"],
                "step_times": engines["spec"].step_times.as_dict()} if policy == "auto" else {}), "specialist": Path(model_dir).name, **checkpoint_id(Path(model_dir)),
            "device": device_name(device), "commit": git_commit(), "requests": len(rows), "batch_size": 1,
            "max_tokens": max_tokens, "repeat": repeat, "interleaved": True,
            "speedup_free": round(free, 3), "speedup_grammar": round(constrained, 3),
            "grammar_over_free": round(constrained / free, 3),
            "grammar_over_free_by_round": [round(ratio(r), 3) for r in range(repeat)],
            "identical_spec_free": same("spec_free", "plain_free"),
            "identical_spec_grammar": same("spec_grammar", "plain_grammar"), **out}


def _figures(secs: dict[str, list[float]], sums: dict[str, dict[str, float]], n_tok: dict[str, int],
             repeat: int) -> dict[str, Any]:
    """Each way's tok/s, tokens per round, ms per step and its parts; acceptance and mask time."""
    out: dict[str, Any] = {}
    for key, c in sums.items():
        steps = max(1.0, c["steps"])
        out[f"{key}_tok_s"] = round(n_tok[key] / sum(secs[key]), 2)
        out[f"{key}_tokens"] = n_tok[key] // repeat
        out[f"{key}_ms_per_step"] = round(1e3 * sum(secs[key]) / steps, 4)  # wall, generate() included
        out[f"{key}_draft_verify_commit_ms"] = [round(1e3 * c[x] / steps, 4) for x in ("draft_s", "verify_s", "commit_s")]
        if key.startswith("spec"):
            out[f"{key}_acceptance"] = round(c["accepted"] / c["drafted"], 4) if c["drafted"] else None
        if key.endswith("grammar"):
            out[f"{key}_mask_us_per_step"] = round(1e6 * c["grammar_mask_s"] / max(1.0, c["grammar_steps"]), 1)
    out["masked_drafts"] = int(sums["spec_grammar"]["grammar_masked_drafts"]) // repeat
    out["grammar_drafts"] = int(sums["spec_grammar"]["grammar_drafts"]) // repeat
    return out


def _speedup(secs: dict[str, list[float]], kind: str, r: int | None = None) -> float:
    """Plain over speculative seconds for the same requests (all rounds, or round r)."""
    pick = (lambda v: sum(v)) if r is None else (lambda v: v[r])  # noqa: E731
    return pick(secs[f"plain_{kind}"]) / pick(secs[f"spec_{kind}"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tool_validity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="a specialist directory (repeat; default: the five defaults)")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--mode", choices=["tool_required", "response_format"], default="tool_required")
    ap.add_argument("--grammar", choices=["on", "off"], default="on")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--results", type=Path)
    ap.add_argument("--speed", action="store_true", help="speculation's speed-up with the grammar vs without (batch 1)")
    ap.add_argument("--spec-k", type=int, default=3, help="with --speed: drafts per step")
    ap.add_argument("--repeat", type=int, default=1, help="with --speed: rounds over the requests (each must repeat its tokens)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--policy", choices=["on", "auto"], default="on",
                    help="with --speed: the speculative engine's mode (auto: the gate judges free and guided steps apart)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    rows = read_jsonl(args.data, args.limit)
    for model in args.model or DEFAULT_MODELS:
        row = (speed(model, rows, args.mode, args.max_tokens, args.spec_k, args.device, args.repeat, args.policy, args.dtype)
               if args.speed
               else evaluate(model, rows, args.mode, args.grammar == "on", args.max_tokens, args.device))
        record(args.results, row)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
