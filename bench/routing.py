"""Content routing on the held-out prompts: accuracy per domain and routing time per request.

  python -m bench.routing [--model-dir deploy/router] [--data bench/data] [--results bench/results/routing.jsonl]

Every row of bench/data/<domain>/{chat_prompts,tool_convs,prompts}.jsonl is routed end to end with
`Router.route("auto", messages)` (completion rows become one user message), the label being the
directory name. The headline accuracy routes the messages alone, as the HTTP API's `route(model,
messages)` does; `accuracy_with_tools` also passes the rows' offered tools. Times are per request,
one thread, after a warm-up pass; the threshold is 0 so that every decision is the classifier's own.
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import device_name, git_commit, read_jsonl, record
from router.classifier import WEIGHTS_FILE, ContentClassifier
from router.routing import Router

log = logging.getLogger("bench.routing")

SETS = ("chat_prompts", "tool_convs", "prompts")


def load_requests(data: Path, domains: list[str]) -> list[dict[str, Any]]:
    """[{"domain", "set", "messages", "tools"}] for every held-out row of the given domains."""
    out = []
    for domain in domains:
        for name in SETS:
            path = data / domain / f"{name}.jsonl"
            if not path.is_file():
                continue
            for row in read_jsonl(path):
                messages = row["messages"] if "messages" in row else [{"role": "user", "content": row["prompt"]}]
                out.append({"domain": domain, "set": name, "messages": messages, "tools": row.get("tools")})
    return out


def run(router: Router, requests: list[dict[str, Any]], with_tools: bool) -> tuple[list[str], list[float]]:
    chosen, times = [], []
    for req in requests:
        t = time.perf_counter()
        decision = router.route("auto", req["messages"], req["tools"] if with_tools else None)
        times.append((time.perf_counter() - t) * 1e3)
        chosen.append(decision.specialist)
    return chosen, times


def accuracy(requests: list[dict[str, Any]], chosen: list[str], key: str | None = None) -> dict[str, float] | float:
    hits = [r["domain"] == c for r, c in zip(requests, chosen)]
    if key is None:
        return round(float(np.mean(hits)), 4)
    groups: dict[str, list[bool]] = {}
    for r, h in zip(requests, hits):
        groups.setdefault(r[key], []).append(h)
    return {k: round(float(np.mean(v)), 4) for k, v in groups.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=Path("deploy/router"))
    p.add_argument("--data", type=Path, default=Path("bench/data"))
    p.add_argument("--results", type=Path, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    if not (args.model_dir / WEIGHTS_FILE).is_file():
        log.error("no trained classifier in %s (python -m router.train --corpora data/corpora --out %s)",
                  args.model_dir, args.model_dir)
        return 2
    clf = ContentClassifier.load(args.model_dir)
    made = {k: clf.meta.get(k) for k in ("date", "commit", "corpus_sha256", "val_accuracy")}
    print(f"classifier: {args.model_dir} labels={clf.labels} made={made}")
    requests = load_requests(args.data, clf.labels)
    if not requests:
        log.error("no held-out rows under %s", args.data)
        return 2
    router = Router(clf.labels, clf, default=clf.labels[0], threshold=0.0)
    run(router, requests[:200], with_tools=False)  # warm-up
    chosen, times = run(router, requests, with_tools=False)
    chosen_tools, _ = run(router, requests, with_tools=True)

    per_domain = accuracy(requests, chosen, "domain")
    per_set = accuracy(requests, chosen, "set")
    for domain, acc in per_domain.items():
        mine = [i for i, r in enumerate(requests) if r["domain"] == domain]
        by_set = accuracy([requests[i] for i in mine], [chosen[i] for i in mine], "set")
        print(f"{domain:>8}: {acc:.4f}  " + "  ".join(f"{k} {v:.3f}" for k, v in by_set.items()))
    total = accuracy(requests, chosen)
    p50, p99 = (round(float(np.percentile(times, q)), 4) for q in (50, 99))
    print(f" overall: {total:.4f} (with offered tools {accuracy(requests, chosen_tools):.4f}), n={len(requests)}")
    print(f"    time: p50 {p50:.3f} ms, p99 {p99:.3f} ms per request (messages -> decision, one thread)")
    row = {"bench": "routing", "accuracy": total, "per_domain": per_domain, "p50_ms": p50, "p99_ms": p99,
           "n": len(requests), "per_set": per_set, "accuracy_with_tools": accuracy(requests, chosen_tools),
           "model_dir": str(args.model_dir), "classifier_date": clf.meta.get("date"), "device": device_name("cpu"),
           "commit": git_commit()}
    record(args.results, row)
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
