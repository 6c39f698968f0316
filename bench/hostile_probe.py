"""Probes the holes of issue 14 (tool-schema $ref file read and SSRF, ReDoS, strict types, seed range,
unsupported parameters, surrogates, body size, a short body, a huge `model` in traces) against a running server:

  python -m bench.hostile_probe [URL] [BIG_BYTES]     # URL defaults to http://127.0.0.1:8000

Each line prints the status, the seconds and the start of the body; an assert fails if a hole is open.
The short-body probe waits the router's body_read_timeout_s (30 s by default). Needs the shell specialist."""
import json, socket, sys, tempfile, threading, time, os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import requests

BASE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
URL = BASE + "/v1/chat/completions"
USER = [{"role": "user", "content": "List the files in /tmp with their sizes."}]
hits = []
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        hits.append(self.path); self.send_response(200); self.end_headers(); self.wfile.write(b'{"type":"string"}')
    def log_message(self, *a): pass
srv = ThreadingHTTPServer(("127.0.0.1", 0), H); threading.Thread(target=srv.serve_forever, daemon=True).start()
bait = f"http://127.0.0.1:{srv.server_port}"
secret = os.path.join(tempfile.mkdtemp(), "secret.json"); open(secret, "w").write('{"password": "hunter2"}')

def forced(params, **kw):
    return {"model": "shell", "messages": USER, "max_tokens": 40, "tools": [{"type": "function", "function": {
        "name": "run_shell", "description": "Run a shell command and return its output.", "parameters": params}}],
        "tool_choice": {"type": "function", "function": {"name": "run_shell"}}, **kw}

def show(name, r, t0):
    print(f"{name:34s} {r.status_code} {time.monotonic()-t0:6.2f}s {r.text[:150]}")

for stream in (False, True):
    t0 = time.monotonic(); r = requests.post(URL, json=forced({"type": "object", "properties": {"command": {"$ref": f"file://{secret}#/nope"}}}, stream=stream), timeout=60)
    show(f"file $ref (stream={stream})", r, t0); assert "hunter2" not in r.text
    t0 = time.monotonic(); r = requests.post(URL, json=forced({"type": "object", "properties": {"command": {"$ref": f"{bait}/x.json"}}}, stream=stream), timeout=60)
    show(f"http $ref (stream={stream})", r, t0)
sneaky = {"$id": f"{bait}/root.json", "type": "object", "properties": {"command": {"$id": f"{bait}/o.json", "$ref": "#/nope"}}}
t0 = time.monotonic(); r = requests.post(URL, json=forced(sneaky), timeout=60); show("$id + local ref", r, t0)
print("bait server hits:", hits)

slow = {"type": "object", "properties": {"command": {"type": "string", "pattern": "^(?:(?:|.?)(?:|.?)){25}(?!)"},
        "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600}}, "required": ["command"],
        "additionalProperties": False, "propertyNames": {"pattern": "^(?:|\u0001?){26}!$"}}
res = {}
def run(): t = time.monotonic(); res["r"] = requests.post(URL, json=forced(slow, max_tokens=60), timeout=60); res["s"] = time.monotonic() - t
th = threading.Thread(target=run); th.start(); worst = 0.0
while th.is_alive():
    t = time.monotonic(); requests.get(BASE + "/v1/models", timeout=30); worst = max(worst, time.monotonic() - t); time.sleep(0.02)
th.join(); m = res["r"].json()["choices"][0]["message"]
print(f"ReDoS pattern: chat {res['s']:.2f}s, worst /v1/models {worst:.3f}s, errors {[e['error'][:70] for e in m.get('tool_call_errors') or []]}")

for kw in [{"stream": "yes"}, {"temperature": "0.5"}, {"max_tokens": True}, {"temperature": 0.7, "seed": 18446744073709551616},
           {"temperature": 0.7, "seed": -1}, {"logit_bias": {"1": 5}}, {"presence_penalty": 0.5}, {"response_format": {"type": "json_object"}}]:
    t0 = time.monotonic(); show(json.dumps(kw)[:34], requests.post(URL, json={"model": "shell", "messages": USER, "max_tokens": 2, **kw}, timeout=60), t0)
t0 = time.monotonic(); show("content \\ud800", requests.post(URL, data=b'{"model":"shell","messages":[{"role":"user","content":"\\ud800"}]}', headers={"content-type": "application/json"}, timeout=60), t0)
t0 = time.monotonic(); show("content raw \\xed\\xa0\\x80", requests.post(URL, data=b'{"model":"shell","messages":[{"role":"user","content":"\xed\xa0\x80"}]}', headers={"content-type": "application/json"}, timeout=60), t0)
big = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000_000
t0 = time.monotonic(); show(f"{big} B message", requests.post(URL, json={"model": "shell", "messages": [{"role": "user", "content": "x" * big}]}, timeout=120), t0)
t0 = time.monotonic(); show("900 KB message", requests.post(URL, json={"model": "shell", "messages": [{"role": "user", "content": "ab " * 300_000}]}, timeout=120), t0)
host, port = BASE.split("//")[1].split(":")
s = socket.create_connection((host, int(port)), timeout=200)
s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\": ")
t0 = time.monotonic(); data = b""
while True:
    part = s.recv(65536)
    if not part: break
    data += part
print(f"short body: {time.monotonic()-t0:.1f}s, closed; got {data[:12]!r} ... {data[-120:]!r}")
