"""The content classifier: hashed n-gram features and a linear (multinomial logistic) layer.

A text becomes a sparse vector over `2**buckets_log2` buckets: byte n-grams (`char_ngrams`) and word
unigrams/bigrams (identifiers, numbers and runs of up to three punctuation characters, so `::`, `->`,
`${` and `]:` are tokens). Each group gets sublinear counts (1 + log c) and unit L2 norm; a request
is a weighted sum of such vectors (one per message part), normalized again. The logits are
`x @ W + b`. Hashing is deterministic (no `hash()`, whose seed changes per process), so the features
computed at training time are the features computed at serving time.

Inference is numpy only: one gather and one small matmul per request. The weights are stored as
`classifier.safetensors` (`weight` [buckets, C] float16, `bias` [C] float32) beside
`classifier.json` (labels, feature config, how it was trained).
"""

from __future__ import annotations

import json
import logging
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from safetensors.numpy import load_file, save_file

log = logging.getLogger(__name__)

WEIGHTS_FILE = "classifier.safetensors"
META_FILE = "classifier.json"
FORMAT = 1

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+|[^\sA-Za-z0-9_]{1,3}")
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_PRIME = np.uint64(0x100000001B3)


class ClassifierFileError(ValueError):
    """The classifier directory is missing a file, or its files do not agree with each other."""


class FeatureConfig(BaseModel):
    """How text becomes a sparse vector; stored in classifier.json and checked on load."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    buckets_log2: int = Field(18, ge=8, le=24)
    char_ngrams: tuple[int, ...] = (3, 4, 5)
    word_ngrams: int = Field(2, ge=1, le=2)
    char_weight: float = 1.0
    word_weight: float = 1.0
    max_chars: int = Field(4096, ge=64)  # longer parts keep their first 3/4 and last 1/4

    @property
    def buckets(self) -> int:
        return 1 << self.buckets_log2


@dataclass
class SparseVector:
    index: np.ndarray  # [F] int64 bucket ids, unique
    value: np.ndarray  # [F] float32, unit L2 norm (or empty)


def _mix(z: np.ndarray) -> np.ndarray:  # [N] uint64 -> [N] uint64 (splitmix64 finalizer)
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _counted(ids: np.ndarray, weight: float) -> tuple[np.ndarray, np.ndarray]:
    """ids: [N] bucket ids with repeats -> unique ids [U] and their (1 + log c) values scaled to norm `weight`."""
    if ids.size == 0:
        return ids.astype(np.int64), np.zeros(0, np.float32)
    uniq, counts = np.unique(ids, return_counts=True)
    vals = 1.0 + np.log(counts.astype(np.float32))
    vals *= weight / float(np.sqrt(np.dot(vals, vals)))
    return uniq.astype(np.int64), vals.astype(np.float32)


class FeatureHasher:
    """Text -> hashed sparse features, per the FeatureConfig."""

    def __init__(self, config: FeatureConfig) -> None:
        self.config = config
        self._shift = np.uint64(64 - config.buckets_log2)
        self._char_salt = {n: np.uint64(0x9E3779B97F4A7C15 * (n + 1) % (1 << 64)) for n in config.char_ngrams}
        self._uni_salt = np.uint64(0xD6E8FEB86659FD93)
        self._bi_salt = np.uint64(0xA0761D6478BD642F)

    def _bucket(self, h: np.ndarray) -> np.ndarray:  # [N] uint64 -> [N] int64 in [0, buckets)
        return (_mix(h) >> self._shift).astype(np.int64)

    def _clip(self, text: str) -> str:
        limit = self.config.max_chars
        if len(text) <= limit:
            return text
        head = limit * 3 // 4
        return text[:head] + "\n" + text[len(text) - (limit - head):]

    def char_ids(self, text: str) -> np.ndarray:  # -> [N] int64 bucket ids of the byte n-grams
        data = np.frombuffer(text.encode("utf-8", "replace"), dtype=np.uint8).astype(np.uint64)
        out = []
        for n in self.config.char_ngrams:
            if data.size < n:
                continue
            m = data.size - n + 1
            h = data[:m].copy()
            for k in range(1, n):  # n <= 7 bytes fit exactly in 64 bits
                h |= data[k:k + m] << np.uint64(8 * k)
            out.append(self._bucket(h ^ self._char_salt[n]))
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def word_ids(self, text: str) -> np.ndarray:  # -> [N] int64 bucket ids of word unigrams (+ bigrams)
        tokens = _WORD.findall(text)
        if not tokens:
            return np.zeros(0, np.int64)
        h = np.fromiter((zlib.crc32(t.encode("utf-8", "replace")) for t in tokens), dtype=np.uint64, count=len(tokens))
        ids = [self._bucket(h ^ self._uni_salt)]
        if self.config.word_ngrams >= 2 and h.size > 1:
            ids.append(self._bucket((h[:-1] * _PRIME + h[1:]) ^ self._bi_salt))
        return np.concatenate(ids)

    def part(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """One text -> (ids [F] int64, values [F] float32); each feature group has norm = its weight."""
        text = self._clip(text)
        ci, cv = _counted(self.char_ids(text), self.config.char_weight)
        wi, wv = _counted(self.word_ids(text), self.config.word_weight)
        return np.concatenate([ci, wi]), np.concatenate([cv, wv])

    def vectorize(self, parts: Sequence[tuple[str, float]]) -> SparseVector:
        """Weighted texts -> one unit-norm sparse vector (empty when there is no text)."""
        ids, vals = [], []
        for text, weight in parts:
            if not text or weight <= 0.0:
                continue
            i, v = self.part(text)
            ids.append(i)
            vals.append(v * np.float32(weight))
        if not ids:
            return SparseVector(np.zeros(0, np.int64), np.zeros(0, np.float32))
        # char and word buckets (and the parts) may share buckets: merge them
        index, inverse = np.unique(np.concatenate(ids), return_inverse=True)
        value = np.bincount(inverse, weights=np.concatenate(vals)).astype(np.float32)
        norm = float(np.sqrt(np.dot(value, value)))
        if norm > 0.0:
            value = value / np.float32(norm)
        return SparseVector(index.astype(np.int64), value.astype(np.float32))


def softmax(logits: np.ndarray) -> np.ndarray:  # [C] -> [C]
    z = np.exp(logits - logits.max())
    return z / z.sum()


class ContentClassifier:
    """Linear classifier over hashed features; `predict` gives a probability per label."""

    def __init__(self, labels: list[str], weight: np.ndarray, bias: np.ndarray, features: FeatureConfig,
                 meta: dict[str, Any] | None = None) -> None:
        # weight: [buckets, C], bias: [C]
        if weight.shape != (features.buckets, len(labels)) or bias.shape != (len(labels),):
            raise ClassifierFileError(f"weights {weight.shape}/{bias.shape} do not match "
                                      f"{features.buckets} buckets x {len(labels)} labels")
        if len(set(labels)) != len(labels) or not labels:
            raise ClassifierFileError(f"labels must be unique and non-empty: {labels}")
        self.labels = list(labels)
        self.weight = np.ascontiguousarray(weight, dtype=np.float32)
        self.bias = np.asarray(bias, dtype=np.float32)
        self.features = features
        self.hasher = FeatureHasher(features)
        self.meta = dict(meta or {})

    @classmethod
    def load(cls, directory: str | Path = "deploy/router") -> "ContentClassifier":
        directory = Path(directory)
        meta_path, weights_path = directory / META_FILE, directory / WEIGHTS_FILE
        if not meta_path.is_file() or not weights_path.is_file():
            raise ClassifierFileError(f"{directory} needs {META_FILE} and {WEIGHTS_FILE} (train with python -m router.train)")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT:
            raise ClassifierFileError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT}")
        tensors = load_file(str(weights_path))
        if set(tensors) != {"weight", "bias"}:
            raise ClassifierFileError(f"{weights_path}: tensors {sorted(tensors)}, expected bias and weight")
        clf = cls(meta["labels"], tensors["weight"], tensors["bias"], FeatureConfig(**meta["features"]), meta)
        log.info("content classifier %s: labels %s, val accuracy %s", directory, clf.labels, meta.get("val_accuracy"))
        return clf

    def save(self, directory: str | Path, meta: dict[str, Any] | None = None) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({"weight": self.weight.astype(np.float16), "bias": self.bias}, str(directory / WEIGHTS_FILE))
        doc = {**self.meta, **(meta or {}), "format": FORMAT, "labels": self.labels,
               "features": self.features.model_dump(mode="json")}
        (directory / META_FILE).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")

    def logits(self, vec: SparseVector) -> np.ndarray:  # -> [C]
        if vec.index.size == 0:
            return self.bias.copy()
        return vec.value @ self.weight[vec.index] + self.bias

    def predict_parts(self, parts: Sequence[tuple[str, float]]) -> dict[str, float]:
        """Weighted texts (see router.routing.request_parts) -> {label: probability}."""
        probs = softmax(self.logits(self.hasher.vectorize(parts)))
        return {label: float(p) for label, p in zip(self.labels, probs)}

    def predict(self, text: str) -> dict[str, float]:
        return self.predict_parts([(text, 1.0)])
