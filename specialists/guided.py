"""The engine's side of constrained decoding (spec/grammar.py does the per-step masks): a request's
grammar compiled on first use and cached, the checkpoint's serving hints (its grammar bounds), and the
commit of each guided row's kept tokens into its grammar after a step. A row whose grammar refuses a
kept token (a grammar that allows no token at some point: every logit was masked) is ended with
finish reason "grammar_error" instead of taking the engine down; the deployment answers it with a 400.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from spec.grammar import GrammarViolation
from spec.stats import SpecStats

log = logging.getLogger(__name__)


def mask_kernel(fused: bool, device: Any) -> Callable[..., None] | None:
    """The GPU's one-kernel grammar mask (specialists/ops/grammar_mask.py) where the fused drafter's
    Triton kernels run; None elsewhere (spec/grammar.py's torch ops)."""
    if not fused or torch.device(device).type != "cuda":
        return None
    from specialists.ops.grammar_mask import apply_bitmask

    return apply_bitmask


def serving_hints(path: Path) -> dict:
    """The checkpoint's serving hints: cantata.json's "serving" object (e.g. its grammar bounds)."""
    meta = path / "cantata.json"
    if not meta.is_file():
        return {}
    try:
        hints = json.loads(meta.read_text()).get("serving", {})
    except (ValueError, AttributeError):
        log.warning("unreadable %s: no serving hints", meta)
        return {}
    return hints if isinstance(hints, dict) else {}


class Grammars:
    """specialists/grammar.py's compiler for one engine, made on first use (thread-safe)."""

    def __init__(self, tokenizer: Any, vocab_size: int, end_ids: set[int], bounds: dict | None) -> None:
        self._args = (tokenizer, vocab_size, end_ids, dict(bounds or {}))
        self._compiler = None
        self._lock = threading.Lock()

    def compile(self, spec: Any) -> Any:  # GrammarSpec -> Constraint
        with self._lock:
            if self._compiler is None:
                from specialists.grammar import Bounds, GrammarCompiler

                tokenizer, vocab_size, end_ids, bounds = self._args
                self._compiler = GrammarCompiler(tokenizer, vocab_size, end_ids, bounds=Bounds(**bounds))
        return self._compiler.compile(spec)

    def stats(self) -> dict:
        return self._compiler.stats() if self._compiler is not None else {}


def commit_grammars(rows: list, runs: list[list[int]], kept: list[int], mask_s: float, totals: SpecStats) -> set[int]:
    """Each guided row's grammar takes exactly its kept tokens (as KV and SSM do); the step's mask time
    is shared among them. -> the rows whose grammar refused a kept token (their requests end)."""
    guided = [(i, row, run, n) for i, (row, run, n) in enumerate(zip(rows, runs, kept))
              if row.seq.guide is not None and row.seq.guide.active]
    failed: set[int] = set()
    if not guided:
        return failed
    share = mask_s / len(guided)
    for i, row, run, n in guided:
        g = row.seq.guide
        try:
            g.commit(run[:n])
        except GrammarViolation as exc:
            log.warning("request %s: %s; ending it", row.seq.request_id, exc)
            g.active = False
            failed.add(i)
        g.mask_s += share
        drafts, masked, seconds = g.take_counts()
        row.seq.stats.record_grammar(drafts, masked, seconds)
        totals.grammar_drafts += drafts
        totals.grammar_masked_drafts += masked
        totals.grammar_mask_s += seconds
    totals.grammar_steps += 1
    return failed
