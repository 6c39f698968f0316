"""Figures of a `bench.serving` run from its outcomes: counts, failures, throughput, TTFT and latency
percentiles, per-specialist and x-speculation counts, the determinism check; and the printed table."""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable

from bench.serving_client import Outcome
from bench.serving_mix import RequestSpec

QUANTILES = (50, 90, 99)


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default);
    None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, float | int | None]:
    out: dict[str, float | int | None] = {"n": len(values)}
    for q in QUANTILES:
        out[f"p{q}"] = percentile(values, q)
    out["mean"] = sum(values) / len(values) if values else None
    out["max"] = max(values) if values else None
    return out


def summarize(specs: list[RequestSpec], outcomes: list[Outcome], wall_s: float) -> dict:
    """All figures of one load run (outcomes in any order, one per spec)."""
    by_index = {s.index: s for s in specs}
    ok = [o for o in outcomes if o.ok]
    tokens = sum(o.completion_tokens or 0 for o in ok)
    auto = [o for o in ok if by_index[o.index].model == "auto"]
    tool_ok = [o for o in ok if by_index[o.index].tool]
    return {
        "requests": len(outcomes),
        "ok": len(ok),
        "failed": len(outcomes) - len(ok),
        "failures": dict(Counter(o.failure for o in outcomes if not o.ok)),
        "http_status": {str(k): v for k, v in sorted(Counter(o.status for o in outcomes if o.status).items())},
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "missing_usage": sum(1 for o in ok if o.completion_tokens is None),
        "ttft_s": distribution([o.ttft_s for o in ok if o.stream and o.ttft_s is not None]),
        "latency_s": distribution([o.latency_s for o in ok if o.latency_s is not None]),
        "latency_stream_s": distribution([o.latency_s for o in ok if o.stream and o.latency_s is not None]),
        "latency_nonstream_s": distribution([o.latency_s for o in ok if not o.stream and o.latency_s is not None]),
        "per_specialist": dict(sorted(Counter(o.specialist for o in ok if o.specialist).items())),
        "x_speculation": dict(sorted(Counter(o.speculation_header for o in ok if o.speculation_header).items())),
        "speculation_used": dict(sorted(Counter(o.speculation_used for o in ok if o.speculation_used).items())),
        "finish_reasons": dict(sorted(Counter(o.finish_reason or "none" for o in ok).items())),
        "mix": {"stream": sum(s.stream for s in specs), "tool": sum(s.tool for s in specs),
                "sampled": sum(s.sampled for s in specs), "auto": sum(s.model == "auto" for s in specs)},
        "auto_routed_to_prompt_domain": sum(o.specialist == by_index[o.index].domain for o in auto),
        "auto_ok": len(auto),
        "tool_requests_calling": sum(bool(o.tool_calls) for o in tool_ok),
        "tool_requests_ok": len(tool_ok),
    }


def compare_determinism(sample: list[RequestSpec], alone: dict[int, Outcome], loaded: dict[int, Outcome]) -> dict:
    """Greedy outputs sent alone against the same requests under load: identical text and finish."""
    mismatches = []
    identical = 0
    for spec in sample:
        a, b = alone.get(spec.index), loaded.get(spec.index)
        if a is not None and b is not None and a.ok and b.ok and (a.text, a.finish_reason) == (b.text, b.finish_reason):
            identical += 1
            continue
        mismatches.append({"index": spec.index, "model": spec.model, "stream": spec.stream,
                           "alone": _show(a), "under_load": _show(b)})
    return {"total": len(sample), "identical": identical, "mismatches": mismatches}


def _show(o: Outcome | None) -> str:
    if o is None:
        return "(not sent)"
    if not o.ok:
        return f"(failed: {o.failure})"
    return f"[{o.finish_reason}] {o.text[:100]!r}"


def _fmt(dist: dict) -> str:
    if not dist["n"]:
        return "n=0"
    return "  ".join(f"p{q} {dist[f'p{q}'] * 1000:8.1f} ms" for q in QUANTILES) + f"  (n={dist['n']})"


def _counts(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) or "-"


def format_table(f: dict, determinism: dict | None) -> str:
    """The printed report of one run."""
    rows = [
        ("requests", f"{f['ok']} ok / {f['failed']} failed of {f['requests']}"
                     f"  (mix: {_counts(f['mix'])})"),
        ("failures", _counts(f["failures"])),
        ("HTTP status", _counts(f["http_status"])),
        ("wall time", f"{f['wall_s']:.2f} s"),
        ("throughput", f"{f['requests_per_s']:.2f} req/s, {f['output_tokens_per_s']:.1f} output tok/s"
                       f" ({f['output_tokens']} tokens)"),
        ("TTFT (streams)", _fmt(f["ttft_s"])),
        ("latency (all)", _fmt(f["latency_s"])),
        ("latency streams", _fmt(f["latency_stream_s"])),
        ("latency non-str.", _fmt(f["latency_nonstream_s"])),
        ("per specialist", _counts(f["per_specialist"])),
        ("x-speculation", _counts(f["x_speculation"])),
        ("speculation used", _counts(f["speculation_used"])),
        ("finish reasons", _counts(f["finish_reasons"])),
        ("auto routing", f"{f['auto_routed_to_prompt_domain']}/{f['auto_ok']} to the prompt's domain"),
        ("tool requests", f"{f['tool_requests_calling']}/{f['tool_requests_ok']} returned tool calls"),
    ]
    if determinism is not None:
        rows.append(("determinism", f"{determinism['identical']}/{determinism['total']} greedy outputs identical"
                                    " alone and under load"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for m in (determinism or {}).get("mismatches", [])[:20]:
        lines.append(f"  mismatch #{m['index']} ({m['model']}, stream={m['stream']}):")
        lines.append(f"    alone:      {m['alone']}")
        lines.append(f"    under load: {m['under_load']}")
    return "\n".join(lines)
