"""What every benchmark shares: reading prompts, naming the checkpoint, recording results."""

from __future__ import annotations

import hashlib
import json
import platform
import time
from pathlib import Path

import torch

from specialists.provenance import git_commit

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # --dtype of the benches

__all__ = ["checkpoint_id", "device_name", "git_commit", "graph_us", "prompt_text", "read_jsonl", "record"]


class PromptRowError(ValueError):
    """A prompts row without what the mode needs (`prompt`, or with --chat `prompt` or `messages`)."""


def prompt_text(row: dict, tokenizer, chat: bool) -> str:
    """A prompts row as the text the model is fed: its `prompt` as is, or with `chat` the row's
    `messages` (or `prompt` as one user message) rendered through the checkpoint's own chat template
    with the generation prompt: what the server feeds a chat model."""
    if not chat:
        if "prompt" not in row:
            raise PromptRowError(f"a row without 'prompt' (keys {sorted(row)}); chat rows need --chat")
        return row["prompt"]
    messages = row.get("messages") or ([{"role": "user", "content": row["prompt"]}] if "prompt" in row else None)
    if not messages:
        raise PromptRowError(f"a row with neither 'messages' nor 'prompt' (keys {sorted(row)})")
    if not getattr(tokenizer, "chat_template", None):
        raise PromptRowError("--chat: the checkpoint's tokenizer has no chat template")
    return tokenizer.apply_chat_template(messages, tools=row.get("tools"), add_generation_prompt=True, tokenize=False)


def read_jsonl(path: Path, limit: int | None = None) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
                if limit is not None and len(rows) >= limit:
                    break
    return rows


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def graph_us(fns: list, dev: str = "cuda") -> float:
    """us per call: the calls (e.g. one per weight copy, so weights stream from HBM) captured as one CUDA
    graph, best of 3 x 20 replays; on CPU (Triton's interpreter) one call's wall time."""
    if dev == "cpu":  # the interpreter: one call's wall time
        t0 = time.perf_counter()
        fns[0]()
        return 1e6 * (time.perf_counter() - t0)
    for fn in fns:  # eager warm-up: compilation and lazy buffers outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, 1e3 * start.elapsed_time(end) / 20 / len(fns))
    return best


def checkpoint_id(model_dir: Path) -> dict:
    """Which checkpoint was loaded: path, weights hash prefix, and how it was made if recorded."""
    model_dir = Path(model_dir)
    ident = {"path": str(model_dir)}
    for name in ("model.safetensors", "mtp.safetensors"):
        f = model_dir / name
        if f.is_file():
            ident[name] = hashlib.sha256(f.read_bytes()).hexdigest()[:12]
    meta = model_dir / "cantata.json"
    if meta.is_file():
        ident["made"] = {k: v for k, v in json.loads(meta.read_text()).items() if k in ("domain", "commit", "device", "corpus_sha256")}
    return ident


def record(results: Path | None, row: dict) -> None:
    if results is None:
        return
    results.parent.mkdir(parents=True, exist_ok=True)
    with open(results, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
