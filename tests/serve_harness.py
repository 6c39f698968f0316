"""The `serve run deploy/ensemble.yaml` of the end-to-end tests, as the README starts it (token auth,
the proxy guard), and the clients of the replica-death tests: raw SSE streams and plain requests
(requests, so that a cut body shows as a transport error and every x-request-id header is seen),
each recorded as an Outcome, and the kill itself. Used by test_serve_e2e.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[1]
BASE = "http://127.0.0.1:8000"
BIN = Path(sys.executable).parent
STARTUP_LIMIT_S = 120.0
# the README's environment for `serve run` (besides the admin token and the trace file)
README_ENV = {"RAY_AUTH_MODE": "token", "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "router.proxy_guard:middlewares"}


@dataclass
class Server:
    env: dict[str, str]
    trace_file: Path
    startup_s: float
    workdir: Path
    pid: int  # the `serve run` process (its raylet's workers are the replicas)


def port_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def terminate(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if `proc` is still there after 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def slowest_get_while(worker: threading.Thread, url: str, timeout: float) -> float:
    """Seconds of the slowest GET `url` (each must answer 200) sent back to back while `worker` runs;
    joins it."""
    worst = 0.0
    while worker.is_alive():
        t0 = time.monotonic()
        assert requests.get(url, timeout=timeout).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.02)
    worker.join()
    return worst


def stop(proc: subprocess.Popen, env: dict[str, str]) -> None:
    terminate(proc)
    subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)


def wait_healthy(proc: subprocess.Popen, log: Path, base: str, start: float) -> None:
    """Returns once GET {base}/health is 200; fails the test with the log's tail if `serve run` exits
    or STARTUP_LIMIT_S passes (counted from `start`, a time.monotonic())."""
    while True:
        if proc.poll() is not None:
            pytest.fail(f"serve run exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        if time.monotonic() - start > STARTUP_LIMIT_S:
            pytest.fail(f"/health not 200 within {STARTUP_LIMIT_S} s:\n{log.read_text()[-4000:]}")
        try:
            if requests.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1.0)


@contextmanager
def running_server(work: Path, admin_token: str) -> Iterator[Server]:
    """`serve run deploy/ensemble.yaml` until /health is 200; stopped (and `ray stop --force`) on exit."""
    if port_busy(8000):
        pytest.fail("127.0.0.1:8000 is in use; deploy/ensemble.yaml binds it")
    trace_file = work / "traces.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "RAY_ADDRESS"))}
    env.update(README_ENV, RAY_USAGE_STATS_ENABLED="0", CANTATA_ADMIN_TOKEN=admin_token,
               CANTATA_TRACE_FILE=str(trace_file), PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    log = open(work / "serve.log", "w")
    start = time.monotonic()
    proc = subprocess.Popen([str(BIN / "serve"), "run", "deploy/ensemble.yaml"], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, work / "serve.log", BASE, start)
        yield Server(env, trace_file, time.monotonic() - start, work, proc.pid)
    finally:
        stop(proc, env)
        log.close()


# ---- replica death ---------------------------------------------------------------------------------

PROMPTS = ["Explain std::vector in C++", "How do I use templates in C++?", "What is RAII in C++?",
           "Explain smart pointers", "What does std::move do?", "How does std::map work?"]


@dataclass
class Outcome:
    status: int = 0
    request_ids: list[str] = field(default_factory=list)
    retry_after: str | None = None
    data: list[str] = field(default_factory=list)  # SSE data payloads, in order
    body: dict | None = None  # a JSON answer (non-stream, or an HTTP error)
    cut: str | None = None  # a transport error: the body ended early
    ended_at: float = 0.0

    def last_event(self) -> dict:
        """The event before [DONE]: the finishing chunk, or an error event."""
        return json.loads(self.data[-2])


def _body(i: int, stream: bool, max_tokens: int) -> dict:
    # sampled (seeded) so that answers run long: the streams are still going when the replica dies
    return {"model": "cpp", "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": max_tokens, "temperature": 1.3, "seed": i, "stream": stream}


def _ids(r: requests.Response) -> list[str]:
    return r.raw.headers.getlist("x-request-id")


def stream(base: str, i: int, first_text: threading.Event, max_tokens: int = 256) -> Outcome:
    """One SSE stream; `first_text` is set when any content arrives."""
    out = Outcome()
    try:
        with requests.post(f"{base}/v1/chat/completions", json=_body(i, True, max_tokens), stream=True,
                           timeout=120) as r:
            out.status, out.request_ids, out.retry_after = r.status_code, _ids(r), r.headers.get("retry-after")
            if r.status_code != 200:
                out.body = r.json()
                return out
            for line in r.iter_lines(decode_unicode=True):
                if line:
                    assert line.startswith("data: "), line
                    out.data.append(line[6:])
                    if '"content": "' in line and '"content": ""' not in line:
                        first_text.set()
    except requests.RequestException as exc:
        out.cut = repr(exc)
    finally:
        out.ended_at = time.monotonic()
    return out


def complete(base: str, i: int, max_tokens: int = 256) -> Outcome:
    out = Outcome()
    try:
        r = requests.post(f"{base}/v1/chat/completions", json=_body(i, False, max_tokens), timeout=120)
        out.status, out.request_ids, out.retry_after = r.status_code, _ids(r), r.headers.get("retry-after")
        out.body = r.json()
    except requests.RequestException as exc:
        out.cut = repr(exc)
    out.ended_at = time.monotonic()
    return out


def kill_frozen(pid: int, hold_s: float = 0.3) -> float:
    """SIGSTOP the replica (its streams stay mid-body), then kill -9 it; the time of the kill."""
    os.kill(pid, signal.SIGSTOP)
    time.sleep(hold_s)
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def wait_served(base: str, since: float, within_s: float) -> float:
    """Seconds from `since` until cpp answers a chat request again (the restarted replica)."""
    body = {"model": "cpp", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    while time.monotonic() - since < within_s + 30:
        try:
            if requests.post(f"{base}/v1/chat/completions", json=body, timeout=10).status_code == 200:
                return time.monotonic() - since
        except requests.RequestException:
            pass
        time.sleep(0.25)
    return float("inf")


def _processes() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, argv[0]) for every process on this machine."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                argv0 = (entry / "cmdline").read_bytes().split(b"\0")[0].strip()
            except OSError:
                continue
            found[int(entry.name)] = (int(stat[stat.rindex(")") + 2:].split()[1]), argv0)
    return found


def replica_pid(server: Server, deployment: str) -> int:
    """The PID of `ray::ServeReplica:cantata:<deployment>` in this server's cluster (a worker of the
    raylet that its `serve run` started; other clusters on the machine are left alone)."""
    want = f"ray::ServeReplica:cantata:{deployment}".encode()
    deadline = time.monotonic() + 20  # a replica that is being (re)started has no such process yet
    while True:
        procs = _processes()
        raylets = {pid for pid, (ppid, argv0) in procs.items() if ppid == server.pid and argv0.endswith(b"/raylet")}
        # Ray retitles a worker while it runs a task ("...:router.handle_request"): match the prefix
        pids = [pid for pid, (ppid, argv0) in procs.items()
                if ppid in raylets and (argv0 == want or argv0.startswith(want + b"."))]
        if len(pids) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    titles = sorted({argv0 for pid, (ppid, argv0) in procs.items() if ppid in raylets})
    assert len(pids) == 1, f"{want!r} under raylet {raylets}: {pids}; its workers: {titles}"
    return pids[0]
