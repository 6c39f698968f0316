"""HTTP load benchmark of a running Cantata server (like vLLM's benchmark_serving).

    python -m bench.serving [--url http://127.0.0.1:8000] [--num-requests 200] [--concurrency 32]
        [--stream-fraction 0.5] [--tool-fraction 0.2] [--sampling-fraction 0.2] [--auto-fraction 0.25]
        [--max-tokens 64] [--seed 0] [--timeout 300] [--wait-ready 60]
        [--check-determinism [--determinism-sample 32]] [--out bench/results/serving.jsonl]

Sends N chat requests from the held-out sets (bench/data/<domain>/), C at a time, and reports
requests ok / failed, failures by kind (HTTP status, SSE error type, cut stream), throughput,
TTFT and latency percentiles, per-specialist and x-speculation counts. With --check-determinism
it first sends a sample of the greedy requests without tools one at a time, then checks that the
same requests give the same text under load. Exit status 1 when any request failed or an output
differed, 2 when the server is not up.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import logging
import os
import platform
import sys
import time
from pathlib import Path

import aiohttp
from tqdm import tqdm

from bench.common import git_commit, record
from bench.serving_client import Outcome, send
from bench.serving_mix import MixOptions, RequestSpec, build_mix, determinism_sample, load_pools
from bench.serving_report import compare_determinism, format_table, summarize

log = logging.getLogger("bench.serving")
REPO = Path(__file__).resolve().parents[1]


class ServerNotReady(RuntimeError):
    """No server at the URL, or it did not answer /health with 200 in time."""


async def wait_ready(base_url: str, wait_s: float) -> list[str]:
    """Poll GET /health until 200 (then return the served model ids), or raise ServerNotReady."""
    deadline = time.monotonic() + wait_s
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while True:
            try:
                async with session.get(base_url.rstrip("/") + "/health") as resp:
                    if resp.status == 200:
                        async with session.get(base_url.rstrip("/") + "/v1/models") as models:
                            return [m["id"] for m in (await models.json())["data"]]
                    last = f"/health answered {resp.status}: {(await resp.text())[:200]}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise ServerNotReady(f"{base_url} is not ready after {wait_s:.0f} s ({last}); start the server with "
                                     "`serve run deploy/ensemble.yaml` as README's set-up says")
            await asyncio.sleep(1.0)


def _session(concurrency: int, timeout_s: float) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


async def run_sequential(base_url: str, specs: list[RequestSpec], timeout_s: float) -> dict[int, Outcome]:
    """Each request alone, one after the other."""
    out = {}
    async with _session(1, timeout_s) as session:
        for spec in tqdm(specs, desc="alone", unit="req", file=sys.stderr):
            out[spec.index] = await send(session, base_url, spec)
    return out


async def run_load(base_url: str, specs: list[RequestSpec], concurrency: int, timeout_s: float) -> tuple[list[Outcome], float]:
    """All requests with `concurrency` in flight at once (workers pulling from one queue)."""
    queue: asyncio.Queue[RequestSpec] = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    outcomes: list[Outcome] = []
    bar = tqdm(total=len(specs), desc="load", unit="req", file=sys.stderr)

    async def worker(session: aiohttp.ClientSession) -> None:
        while True:
            try:
                spec = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            outcome = await send(session, base_url, spec)
            outcomes.append(outcome)
            bar.update(1)
            if not outcome.ok:
                bar.set_postfix(failed=sum(not o.ok for o in outcomes))

    start = time.perf_counter()
    async with _session(concurrency, timeout_s) as session:
        await asyncio.gather(*(worker(session) for _ in range(min(concurrency, len(specs)))))
    wall = time.perf_counter() - start
    bar.close()
    return outcomes, wall


def machine_info() -> dict:
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "loadavg": list(os.getloadavg())}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--stream-fraction", type=float, default=0.5)
    p.add_argument("--tool-fraction", type=float, default=0.2)
    p.add_argument("--sampling-fraction", type=float, default=0.2, help="temperature 0.8, top_p 0.95, with a seed")
    p.add_argument("--auto-fraction", type=float, default=0.25, help="requests with model 'auto' (else pinned)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--wait-ready", type=float, default=60.0, help="seconds to wait for GET /health to answer 200")
    p.add_argument("--check-determinism", action="store_true")
    p.add_argument("--determinism-sample", type=int, default=32, help="greedy requests sent alone first")
    p.add_argument("--data", type=Path, default=REPO / "bench" / "data")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "serving.jsonl",
                   help="JSONL file the result row is appended to")
    p.add_argument("--no-record", action="store_true", help="do not append a row")
    args = p.parse_args(argv)
    for name in ("stream_fraction", "tool_fraction", "sampling_fraction", "auto_fraction"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            p.error(f"--{name.replace('_', '-')} must be within [0, 1]")
    if min(args.num_requests, args.concurrency, args.max_tokens) < 1 or args.determinism_sample < 0:
        p.error("--num-requests, --concurrency and --max-tokens must be >= 1")
    return args


async def bench(args: argparse.Namespace) -> dict:
    """The whole run: readiness, the optional sequential pass, the load; returns the result row."""
    models = await wait_ready(args.url, args.wait_ready)
    print(f"server {args.url}: models {models}", flush=True)
    opts = MixOptions(num_requests=args.num_requests, stream_fraction=args.stream_fraction,
                      tool_fraction=args.tool_fraction, sampling_fraction=args.sampling_fraction,
                      auto_fraction=args.auto_fraction, max_tokens=args.max_tokens, seed=args.seed)
    specs = build_mix(load_pools(args.data), opts)
    machine = machine_info()
    sample, alone = [], {}
    if args.check_determinism:
        sample = determinism_sample(specs, args.determinism_sample)
        alone = await run_sequential(args.url, sample, args.timeout)
    outcomes, wall = await run_load(args.url, specs, args.concurrency, args.timeout)
    machine["loadavg_after"] = list(os.getloadavg())
    figures = summarize(specs, outcomes, wall)
    determinism = None
    if args.check_determinism:
        determinism = compare_determinism(sample, alone, {o.index: o for o in outcomes})
        determinism["alone_failed"] = sum(not o.ok for o in alone.values())
    return {"bench": "serving", "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "machine": machine, "url": args.url, "models": models,
            "params": {**opts.__dict__, "concurrency": args.concurrency, "timeout_s": args.timeout,
                       "check_determinism": args.check_determinism, "determinism_sample": args.determinism_sample},
            "figures": figures, "determinism": determinism,
            "failure_examples": [{"index": o.index, "failure": o.failure, "message": o.error_message}
                                 for o in outcomes if not o.ok][:10]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        row = asyncio.run(bench(args))
    except ServerNotReady as exc:
        log.error("error: %s", exc)
        return 2
    print(format_table(row["figures"], row["determinism"]))
    print(f"machine: {row['machine']['cpu_count']} CPUs, load average {row['machine']['loadavg'][0]:.2f} before, "
          f"{row['machine']['loadavg_after'][0]:.2f} after; commit {row['commit']}")
    if not args.no_record:
        record(args.out, row)
        print(f"result row appended to {args.out}")
    failed = row["figures"]["failed"] + (row["determinism"] or {}).get("alone_failed", 0)
    det = row["determinism"]
    return 1 if failed or (det is not None and det["identical"] != det["total"]) else 0


if __name__ == "__main__":
    sys.exit(main())
