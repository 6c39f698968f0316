"""Train the content classifier on the project's own corpora (train split; validation to pick the epoch).

    python -m router.train --corpora data/corpora [--chat data/chat] --out deploy/router [--seed 0]

Examples per domain (the label is the corpus domain):
* windows of train documents (40-1500 characters, at line boundaries), as a lone user message, a
  quarter of them inside a domain-neutral request ("Continue this: ..."), like completion prompts;
* conversations of the chat train split (`--chat`), cut after their first user message (or, for
  some, everything but the final answer), the system prompt dropped for some, tools offered for half.
The text of an example is exactly what the router reads (`router.routing.request_parts`).

The model is multinomial logistic regression over hashed features (`router.classifier`), trained
with Adam on class-balanced cross-entropy, batches of CSR rows. Validation examples: windows of
200-600 characters of validation documents and first requests of validation conversations without
tools. The epoch with the best validation accuracy is kept. Output: classifier.safetensors +
classifier.json (labels, feature config, accuracies, corpus and chat hashes, seed, date, commit).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from router.classifier import ContentClassifier, FeatureConfig, FeatureHasher
from router.routing import request_parts
from specialists.provenance import git_commit

log = logging.getLogger("router.train")

DOMAINS = ("cpp", "python", "build", "shell")
NEUTRAL_WRAPS = (
    "Continue this:\n```\n{}```",
    "What does this do?\n{}",
    "Can you explain the following?\n\n{}",
    "Finish the next few lines.\n```\n{}```",
    "Is anything wrong here?\n{}",
)


class TrainDataError(ValueError):
    """The corpora (or chat) directory lacks a domain split, or a split has no usable examples."""


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    corpora: Path
    chat: Path | None = None
    out: Path
    labels: tuple[str, ...] = DOMAINS
    seed: int = 0
    windows_per_doc: int = Field(6, ge=1)  # at most; one per ~2 KB of document
    window_min: int = Field(40, ge=1)
    window_max: int = Field(1500, ge=2)
    wrap_fraction: float = Field(0.25, ge=0.0, le=1.0)
    chat_per_domain: int = Field(8000, ge=0)
    val_windows_per_doc: int = Field(2, ge=1)
    val_chat_per_domain: int = Field(500, ge=0)
    epochs: int = Field(4, ge=1)
    batch_size: int = Field(512, ge=1)
    lr: float = Field(0.02, gt=0.0)
    features: FeatureConfig = FeatureConfig()


@dataclass
class Example:
    parts: list[tuple[str, float]]
    label: int
    source: str  # "doc" or "chat"


@dataclass
class Packed:
    """Examples as CSR sparse rows."""

    index: torch.Tensor  # [nnz] int64 bucket ids
    value: torch.Tensor  # [nnz] float32
    offsets: torch.Tensor  # [E + 1] int64 row starts
    labels: torch.Tensor  # [E] int64
    sources: list[str]

    def batch(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """rows: [b] example ids -> (index [n], value [n], bag offsets [b]) for EmbeddingBag."""
        starts, ends = self.offsets[rows], self.offsets[rows + 1]
        lengths = ends - starts
        bag = torch.cumsum(lengths, 0) - lengths
        pos = torch.arange(int(lengths.sum())) - torch.repeat_interleave(bag, lengths) + torch.repeat_interleave(starts, lengths)
        return self.index[pos], self.value[pos], bag


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def doc_windows(text: str, rng: random.Random, k: int, lo: int, hi: int) -> list[str]:
    """Up to k windows of lo..hi characters that start after a newline and end at one when possible."""
    if len(text.strip()) < lo:
        return []
    out = []
    for _ in range(k):
        start = rng.randrange(max(1, len(text) - lo))
        start = text.rfind("\n", 0, start) + 1
        end = min(len(text), start + rng.randint(lo, hi))
        cut = text.rfind("\n", start + lo, end)
        window = text[start: cut + 1 if cut >= 0 and end < len(text) else end]
        if window.strip():
            out.append(window)
    return out


def corpus_examples(cfg: TrainConfig, split: str, rng: random.Random) -> list[Example]:
    train = split == "train"
    lo, hi = (cfg.window_min, cfg.window_max) if train else (200, 600)
    out: list[Example] = []
    for label, domain in enumerate(cfg.labels):
        path = cfg.corpora / domain / f"{split}.jsonl"
        if not path.is_file():
            raise TrainDataError(f"missing {path}")
        for doc in read_jsonl(path):
            text = doc["text"]
            k = min(cfg.windows_per_doc, 1 + len(text) // 2000) if train else cfg.val_windows_per_doc
            for w in doc_windows(text, rng, k, lo, hi):
                if train and rng.random() < cfg.wrap_fraction:
                    w = rng.choice(NEUTRAL_WRAPS).format(w)
                out.append(Example(request_parts([{"role": "user", "content": w}]), label, "doc"))
    return out


def _first_request(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            return messages[: i + 1]
    return messages


def chat_examples(cfg: TrainConfig, split: str, rng: random.Random) -> list[Example]:
    if cfg.chat is None:
        return []
    train = split == "train"
    limit = cfg.chat_per_domain if train else cfg.val_chat_per_domain
    out: list[Example] = []
    for label, domain in enumerate(cfg.labels):
        path = cfg.chat / domain / f"{split}.jsonl"
        if not path.is_file():
            raise TrainDataError(f"missing {path}")
        convs = list(read_jsonl(path))
        rng.shuffle(convs)
        for conv in convs[:limit]:
            messages, tools = conv["messages"], conv.get("tools")
            if train and rng.random() < 0.3 and messages[-1].get("role") == "assistant":
                prefix = messages[:-1]
            else:
                prefix = _first_request(messages)
            if train and rng.random() < 0.3:
                prefix = [m for m in prefix if m.get("role") != "system"]
            offered = tools if train and rng.random() < 0.5 else None
            parts = request_parts(prefix, offered)
            if parts:
                out.append(Example(parts, label, "chat"))
    return out


def pack(examples: list[Example], hasher: FeatureHasher, desc: str) -> Packed:
    index, value, lengths = [], [], [0]
    for ex in tqdm(examples, desc=f"features ({desc})", unit="ex", mininterval=2.0):
        vec = hasher.vectorize(ex.parts)
        index.append(vec.index)
        value.append(vec.value)
        lengths.append(vec.index.size)
    return Packed(
        index=torch.from_numpy(np.concatenate(index)),
        value=torch.from_numpy(np.concatenate(value)),
        offsets=torch.from_numpy(np.cumsum(np.array(lengths, dtype=np.int64))),
        labels=torch.tensor([ex.label for ex in examples], dtype=torch.long),
        sources=[ex.source for ex in examples],
    )


class LinearBag(torch.nn.Module):
    """x @ W + b over CSR rows. A gather and an index_add: their backward is an index_add too, several
    times cheaper on CPU than EmbeddingBag's (sorting) backward or SparseAdam's coalescing."""

    def __init__(self, buckets: int, classes: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(buckets, classes))
        self.bias = torch.nn.Parameter(torch.zeros(classes))

    def forward(self, index: torch.Tensor, value: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        # index, value: [n]; offsets: [b] bag starts -> logits [b, C]
        rows = torch.index_select(self.weight, 0, index) * value[:, None]  # [n, C]
        lengths = torch.diff(offsets, append=torch.tensor([index.numel()]))
        bag = torch.repeat_interleave(torch.arange(offsets.numel()), lengths)  # [n]
        return torch.zeros(offsets.numel(), self.bias.numel()).index_add(0, bag, rows) + self.bias


@torch.no_grad()
def predictions(model: LinearBag, data: Packed, batch_size: int = 4096) -> torch.Tensor:  # -> [E] label ids
    out = []
    for s in range(0, len(data.labels), batch_size):
        rows = torch.arange(s, min(s + batch_size, len(data.labels)))
        out.append(model(*data.batch(rows)).argmax(-1))
    return torch.cat(out)


def accuracy_report(pred: torch.Tensor, data: Packed, labels: tuple[str, ...]) -> dict[str, Any]:
    hit = pred == data.labels
    src = np.array(data.sources)
    report: dict[str, Any] = {"accuracy": round(float(hit.float().mean()), 4), "n": len(hit)}
    report["per_domain"] = {name: round(float(hit[data.labels == i].float().mean()), 4)
                            for i, name in enumerate(labels) if bool((data.labels == i).any())}
    report["per_source"] = {s: round(float(hit[torch.from_numpy(src == s)].float().mean()), 4) for s in sorted(set(src))}
    return report


def data_hashes(cfg: TrainConfig) -> dict[str, str]:
    """corpus_sha256 from the corpora manifest (else of the train files), chat_sha256 of the chat train files."""
    out: dict[str, str] = {}
    manifest = cfg.corpora / "manifest.json"
    if manifest.is_file() and "corpus_sha256" in (doc := json.loads(manifest.read_text())):
        out["corpus_sha256"] = doc["corpus_sha256"]
    else:
        out["corpus_sha256"] = _files_sha256([cfg.corpora / d / "train.jsonl" for d in cfg.labels])
    if cfg.chat is not None:
        out["chat_sha256"] = _files_sha256([cfg.chat / d / "train.jsonl" for d in cfg.labels])
    return out


def _files_sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def _datasets(cfg: TrainConfig) -> tuple[Packed, Packed]:
    """The training and validation examples (corpus windows and first chat requests), hashed."""
    rng = random.Random(f"{cfg.seed}:router")
    hasher = FeatureHasher(cfg.features)
    train_ex = corpus_examples(cfg, "train", rng) + chat_examples(cfg, "train", rng)
    val_ex = corpus_examples(cfg, "validation", rng) + chat_examples(cfg, "validation", rng)
    if not train_ex or not val_ex:
        raise TrainDataError(f"no examples: train {len(train_ex)}, validation {len(val_ex)}")
    log.info("examples: train %d, validation %d", len(train_ex), len(val_ex))
    return pack(train_ex, hasher, "train"), pack(val_ex, hasher, "validation")


def _fit(cfg: TrainConfig, model: LinearBag, train_data: Packed, val_data: Packed,
         class_weight: torch.Tensor) -> tuple[tuple[float, int, dict[str, torch.Tensor]], list[dict[str, Any]]]:
    """Adam with a linearly decaying rate over cfg.epochs; returns the best validation epoch
    (accuracy, epoch, state dict) and each epoch's loss and validation accuracy."""
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=True)
    loss_fn = torch.nn.CrossEntropyLoss(weight=class_weight)
    gen = torch.Generator().manual_seed(cfg.seed)
    n = len(train_data.labels)
    steps_per_epoch = (n + cfg.batch_size - 1) // cfg.batch_size
    decay = lambda s: max(0.1, 1.0 - s / (cfg.epochs * steps_per_epoch))  # noqa: E731 (linear, floored)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, decay)
    best: tuple[float, int, dict[str, torch.Tensor]] = (-1.0, -1, {})
    history = []
    bar = tqdm(total=cfg.epochs * steps_per_epoch, desc="train", unit="step", mininterval=1.0)
    for epoch in range(cfg.epochs):
        model.train()
        order = torch.randperm(n, generator=gen)
        total = 0.0
        for s in range(0, n, cfg.batch_size):
            rows = order[s: s + cfg.batch_size]
            loss = loss_fn(model(*train_data.batch(rows)), train_data.labels[rows])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(rows)
            bar.update(1)
        model.eval()
        val_acc = float((predictions(model, val_data) == val_data.labels).float().mean())
        history.append({"epoch": epoch + 1, "train_loss": round(total / n, 4), "val_accuracy": round(val_acc, 4)})
        bar.set_postfix(loss=f"{total / n:.4f}", val=f"{val_acc:.4f}")
        log.info("epoch %d: train loss %.4f, validation accuracy %.4f", epoch + 1, total / n, val_acc)
        if val_acc > best[0]:
            best = (val_acc, epoch + 1, {k: v.detach().clone() for k, v in model.state_dict().items()})
    bar.close()
    return best, history


def train(cfg: TrainConfig) -> tuple[ContentClassifier, dict[str, Any]]:
    """Build the examples, fit, keep the best validation epoch; returns the classifier and its report."""
    t0 = time.perf_counter()
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    train_data, val_data = _datasets(cfg)
    classes = len(cfg.labels)
    counts = torch.bincount(train_data.labels, minlength=classes).float()
    if bool((counts == 0).any()):
        raise TrainDataError(f"a label has no training examples: {dict(zip(cfg.labels, counts.tolist()))}")
    model = LinearBag(cfg.features.buckets, classes)
    best, history = _fit(cfg, model, train_data, val_data, class_weight=counts.sum() / (classes * counts))
    model.load_state_dict(best[2])
    model.eval()
    train_report = accuracy_report(predictions(model, train_data), train_data, cfg.labels)
    val_report = accuracy_report(predictions(model, val_data), val_data, cfg.labels)
    report = {
        "train_accuracy": train_report["accuracy"], "val_accuracy": val_report["accuracy"],
        "train": train_report, "validation": val_report, "best_epoch": best[1], "history": history,
        **data_hashes(cfg), "seed": cfg.seed,
        "config": cfg.model_dump(mode="json", exclude={"corpora", "chat", "out", "features"}),
        "corpora": str(cfg.corpora), "chat": None if cfg.chat is None else str(cfg.chat),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(), "train_seconds": round(time.perf_counter() - t0, 1),
    }
    weight = model.weight.detach().numpy()  # [buckets, C]
    clf = ContentClassifier(list(cfg.labels), weight, model.bias.detach().numpy(), cfg.features, report)
    return clf, report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m router.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpora", type=Path, required=True)
    p.add_argument("--chat", type=Path, default=None, help="synthetic conversations (train/validation splits)")
    p.add_argument("--out", type=Path, default=Path("deploy/router"))
    p.add_argument("--labels", nargs="+", default=list(DOMAINS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--windows-per-doc", type=int, default=6)
    p.add_argument("--chat-per-domain", type=int, default=8000)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--buckets-log2", type=int, default=18)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)  # one core, and the same float sums on every machine
    cfg = TrainConfig(corpora=args.corpora, chat=args.chat, out=args.out, labels=tuple(args.labels), seed=args.seed,
                      epochs=args.epochs, windows_per_doc=args.windows_per_doc, chat_per_domain=args.chat_per_domain,
                      lr=args.lr, features=FeatureConfig(buckets_log2=args.buckets_log2))
    clf, report = train(cfg)
    clf.save(cfg.out)
    log.info("wrote %s: train accuracy %.4f, validation accuracy %.4f (epoch %d), %.1f s", cfg.out,
             report["train_accuracy"], report["val_accuracy"], report["best_epoch"], report["train_seconds"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
