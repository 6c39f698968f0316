"""Issue 14's hostile inputs under what actually serves: a real `serve run` (Ray Serve's proxy in front
of the router replica, one specialist) with the README's environment and small limits
(`limits: {max_body_bytes: 1 MiB, body_read_timeout_s: 3}` in the app's args). Each hole of the
issue is tried through the proxy and shown closed; tests/test_hostile_input.py covers the same
without Ray, in more detail.

Its own cluster (`--address local`, a private RAY_TMPDIR, port 8012), stopped by SIGTERM and then by
the PIDs of whatever is left of that cluster (never `ray stop`, which would stop every cluster on
the machine)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
import yaml

from serve_harness import BIN, README_ENV, REPO, port_busy, slowest_get_while, terminate, wait_healthy

pytestmark = pytest.mark.slow

PORT = 8012
BASE = f"http://127.0.0.1:{PORT}"
URL = f"{BASE}/v1/chat/completions"
USER = [{"role": "user", "content": "List the files in /tmp with their sizes."}]
READ_TIMEOUT_S = 3
SLOW_PATTERN = "^(?:(?:|.?)(?:|.?)){25}(?!)"


def _config(trace_dir: Path) -> dict:
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": PORT},
            "applications": [{
                "name": "cantata", "route_prefix": "/", "import_path": "router.app:build_app",
                "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
                "args": {"models_dir": str(REPO / "deploy/models"), "specialists": ["shell"],
                         "default_specialist": "shell", "router_dir": None, "num_threads": 1,
                         "limits": {"max_body_bytes": 1024 * 1024, "body_read_timeout_s": READ_TIMEOUT_S}},
                "deployments": [{"name": "router", "ray_actor_options": {"num_cpus": 0.2}},
                                {"name": "shell", "ray_actor_options": {"num_cpus": 0.4}}]}]}


def _leftovers(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.fixture(scope="module")
def served() -> Iterator[Path]:
    """The server's trace file while it runs."""
    if port_busy(PORT):
        pytest.fail(f"127.0.0.1:{PORT} is in use")
    work = Path(tempfile.mkdtemp(prefix="cs", dir="/tmp"))  # short: Ray's socket paths live under it
    (work / "serve.yaml").write_text(yaml.safe_dump(_config(work)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "RAY_ADDRESS"))}
    env.update(README_ENV, RAY_TMPDIR=str(work), RAY_USAGE_STATS_ENABLED="0", CANTATA_TRACE_FILE=str(work / "t.jsonl"),
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    log = open(work / "serve.log", "w")
    proc = subprocess.Popen([str(BIN / "serve"), "run", "--address", "local", str(work / "serve.yaml")], cwd=REPO,
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    start = time.monotonic()
    try:
        wait_healthy(proc, work / "serve.log", BASE, start)
        yield work / "t.jsonl"
    finally:
        terminate(proc)
        for pid in _leftovers(str(work)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
        shutil.rmtree(work, ignore_errors=True)


class _Hits(BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).hits.append(self.path)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"type": "string"}')

    def log_message(self, *args) -> None:
        pass


def forced(parameters: dict, **extra) -> dict:
    return {"model": "shell", "messages": USER, "max_tokens": 40,
            "tools": [{"type": "function", "function": {"name": "run_shell", "parameters": parameters,
                                                        "description": "Run a shell command and return its output."}}],
            "tool_choice": {"type": "function", "function": {"name": "run_shell"}}, **extra}


def error_of(r: requests.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:400]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_schema_references_are_never_followed(served, tmp_path):
    handler = type("Hits", (_Hits,), {"hits": []})
    bait = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=bait.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{bait.server_port}"
    secret = tmp_path / "secret.json"
    secret.write_text('{"password": "hunter2-DO-NOT-LEAK"}')
    try:
        for stream in (False, True):
            for ref in (f"file://{secret}#/nope", f"{url}/s.json"):
                r = requests.post(URL, json=forced({"type": "object", "properties": {"command": {"$ref": ref}}},
                                                   stream=stream), timeout=60)
                assert error_of(r, 400)["code"] == "schema_reference_not_allowed" and "hunter2" not in r.text
            sneaky = {"$id": f"{url}/r.json", "type": "object",
                      "properties": {"command": {"$id": f"{url}/o.json", "$ref": "#/nope"}}}
            assert requests.post(URL, json=forced(sneaky, stream=stream), timeout=60).status_code == 200
        assert handler.hits == []
    finally:
        bait.shutdown()


def test_catastrophic_pattern_gives_up_and_other_routes_answer(served):
    params = {"type": "object", "properties": {"command": {"type": "string", "pattern": SLOW_PATTERN},
                                               "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600}},
              "required": ["command"], "additionalProperties": False, "propertyNames": {"pattern": "^(?:|\u0001?){26}!$"}}
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(r=requests.post(URL, json=forced(params, max_tokens=60),
                                                                          timeout=60)))
    worker.start()
    worst = slowest_get_while(worker, f"{BASE}/v1/models", timeout=30)
    message = result["r"].json()["choices"][0]["message"]
    assert any("gave up" in e["error"] for e in message.get("tool_call_errors") or []), message
    assert worst < 1.0, worst


@pytest.mark.parametrize("body,status,param", [
    ({"stream": "yes"}, 422, "stream"), ({"temperature": "0.5"}, 422, "temperature"), ({"max_tokens": True}, 422, "max_tokens"),
    ({"temperature": 0.7, "seed": 2**64}, 400, "seed"), ({"temperature": 0.7, "seed": -1}, 400, "seed"),
    ({"logit_bias": {"1": 5}}, 400, "logit_bias"), ({"presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"response_format": {"type": "xml"}}, 400, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"allOf": []}}}}, 400,
     "response_format.json_schema.schema"),
])
def test_bad_parameters(served, body, status, param):
    r = requests.post(URL, json={"model": "shell", "messages": USER, "max_tokens": 2, **body}, timeout=60)
    assert error_of(r, status)["param"] == param


def test_lone_surrogates(served):
    for raw in (b'{"model":"shell","messages":[{"role":"user","content":"\\ud800"}]}',
                b'{"model":"shell","messages":[{"role":"user","content":"\xed\xa0\x80"}]}'):
        r = requests.post(URL, data=raw, headers={"content-type": "application/json"}, timeout=60)
        assert error_of(r, 400)["code"] == "invalid_unicode"


def test_body_limits(served):
    big = {"model": "shell", "messages": [{"role": "user", "content": "x" * 2_000_000}]}
    assert error_of(requests.post(URL, json=big, timeout=60), 413)["code"] == "body_too_large"
    t0 = time.monotonic()  # under the body limit, far over the model's length: refused before tokenizing
    r = requests.post(URL, json={"model": "shell", "messages": [{"role": "user", "content": "ab " * 300_000}]}, timeout=60)
    assert "characters" in error_of(r, 400)["message"] and time.monotonic() - t0 < 5.0
    with socket.create_connection(("127.0.0.1", PORT), timeout=READ_TIMEOUT_S + 30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\": ")
        t0 = time.monotonic()
        data = b""
        while part := s.recv(65536):
            data += part
        took = time.monotonic() - t0
    assert data.startswith(b"HTTP/1.1 408") and b"body_timeout" in data, data[:300]
    assert took < READ_TIMEOUT_S + 5.0, took


def test_a_huge_model_name_writes_a_small_trace(served):
    time.sleep(0.5)
    before = served.stat().st_size if served.exists() else 0
    r = requests.post(URL, json={"model": "m" * 1_000_000, "messages": USER}, timeout=60)
    assert error_of(r, 404)["code"] == "model_not_found" and len(r.content) < 2000
    time.sleep(1.0)
    assert served.stat().st_size - before < 50_000
    assert all(len(json.dumps(s)) < 20_000 for s in map(json.loads, served.read_text().splitlines()))
