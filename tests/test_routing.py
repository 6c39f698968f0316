"""The content router: the shipped classifier on the held-out prompts, routing rules, odd messages,
and a tiny training run."""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

import numpy as np
import pytest

from bench.routing import load_requests
from router.classifier import META_FILE, WEIGHTS_FILE, ClassifierFileError, ContentClassifier, FeatureConfig, FeatureHasher
from router.routing import (EARLIER_USER_WEIGHT, LAST_USER_WEIGHT, TOOLS_WEIGHT, RouteDecision, Router,
                            RouterConfigError, UnknownModelError, request_parts)
from router.train import main as train_main

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "deploy" / "router"
DOMAINS = ["cpp", "python", "build", "shell"]
CPP = ("#include <vector>\ntemplate <typename T>\nclass Stack {\n  std::vector<T> items_;\n public:\n"
       "  void push(const T& x) { items_.push_back(x); }\n};\n")
SHELL_TOOLS = [{"type": "function", "function": {"name": "run_shell", "parameters": {}}},
               {"type": "function", "function": {"name": "man_page", "parameters": {}}}]


@pytest.fixture(scope="module")
def clf() -> ContentClassifier:
    return ContentClassifier.load(SHIPPED)


@pytest.fixture(scope="module")
def router(clf: ContentClassifier) -> Router:
    return Router(DOMAINS, clf, default="python", threshold=0.0)


@pytest.fixture(scope="module")
def held_out(clf: ContentClassifier) -> list[dict]:
    return load_requests(REPO / "bench" / "data", DOMAINS)


def test_shipped_files_are_small_safetensors_with_provenance(clf: ContentClassifier) -> None:
    assert (SHIPPED / WEIGHTS_FILE).stat().st_size + (SHIPPED / META_FILE).stat().st_size < 4 * 2**20
    assert not [p.name for p in SHIPPED.iterdir() if p.suffix in (".pt", ".pth", ".bin", ".pkl")]
    assert clf.labels == [*DOMAINS, "general"]  # general: requests that are about none of the four
    for key in ("train_accuracy", "val_accuracy", "corpus_sha256", "date", "seed", "features"):
        assert key in clf.meta, key
    assert clf.meta["val_accuracy"] >= 0.95


def test_shipped_accuracy_on_held_out_prompts(router: Router, held_out: list[dict]) -> None:
    assert len(held_out) == 2400  # 4 domains x (chat_prompts, tool_convs, prompts) x 200
    hits: dict[str, list[bool]] = {d: [] for d in DOMAINS}
    for req in held_out:
        hits[req["domain"]].append(router.route("auto", req["messages"]).specialist == req["domain"])
    per_domain = {d: float(np.mean(h)) for d, h in hits.items()}
    overall = float(np.mean([x for h in hits.values() for x in h]))
    assert overall >= 0.95, per_domain
    assert min(per_domain.values()) >= 0.93, per_domain


def test_p50_routing_time_under_2ms(router: Router, held_out: list[dict]) -> None:
    sample = held_out[::8]
    for req in sample[:20]:
        router.route("auto", req["messages"])
    times = []
    for req in sample:
        t = time.perf_counter()
        decision = router.route("auto", req["messages"])
        times.append((time.perf_counter() - t) * 1e3)
        assert 0.0 < decision.elapsed_ms <= times[-1]
    assert statistics.median(times) < 2.0


def test_classifier_decision_fields(router: Router) -> None:
    d = router.route("auto", [{"role": "user", "content": CPP}])
    assert isinstance(d, RouteDecision)
    assert (d.specialist, d.reason) == ("cpp", "classifier")
    assert set(d.scores) == set(DOMAINS)
    assert sum(d.scores.values()) == pytest.approx(1.0)
    assert d.confidence == d.scores["cpp"] == max(d.scores.values())


def test_pinned_model_wins_over_content(router: Router) -> None:
    d = router.route("shell", [{"role": "user", "content": CPP}])
    assert (d.specialist, d.reason, d.confidence, d.scores) == ("shell", "pinned", 1.0, {"shell": 1.0})


@pytest.mark.parametrize("model", ["gpt-4o", "Auto", "", "cpp "])
def test_unknown_model_raises(router: Router, model: str) -> None:
    with pytest.raises(UnknownModelError) as exc:
        router.route(model, [{"role": "user", "content": CPP}])
    assert isinstance(exc.value, ValueError) and exc.value.model == model


def test_below_threshold_falls_back_to_default(clf: ContentClassifier) -> None:
    messages = [{"role": "user", "content": "hello"}]
    free = Router(DOMAINS, clf, default="build", threshold=0.0).route("auto", messages)
    assert free.reason == "classifier" and free.confidence < 0.9
    d = Router(DOMAINS, clf, default="build", threshold=0.9).route("auto", messages)
    assert (d.specialist, d.reason) == ("build", "fallback")
    assert d.confidence == pytest.approx(free.scores["build"])
    assert d.scores == pytest.approx(free.scores)
    confident = Router(DOMAINS, clf, default="build", threshold=0.9).route("auto", [{"role": "user", "content": CPP}])
    assert (confident.specialist, confident.reason) == ("cpp", "classifier")


def test_subset_of_specialists_renormalizes(clf: ContentClassifier) -> None:
    r = Router(["cpp", "shell", "writer"], clf, default="writer", threshold=0.0)  # writer: no class of the classifier
    py = [{"role": "user", "content": "def mean(xs):\n    return sum(xs) / len(xs)\n\nimport os\nprint(os.getcwd())\n"}]
    d = r.route("auto", py)
    assert d.specialist in ("cpp", "shell") and set(d.scores) == {"cpp", "shell"}
    assert sum(d.scores.values()) == pytest.approx(1.0)
    assert r.route("auto", [{"role": "user", "content": CPP}]).specialist == "cpp"
    assert r.route("writer", py).reason == "pinned"
    with pytest.raises(UnknownModelError):
        r.route("python", py)  # a label of the classifier, but not served here


def test_router_config_errors(clf: ContentClassifier) -> None:
    with pytest.raises(RouterConfigError):
        Router(DOMAINS, clf, default="rust")
    with pytest.raises(RouterConfigError):
        Router([], None, default="cpp")
    with pytest.raises(RouterConfigError):
        Router(["writer"], clf, default="writer")  # the classifier can pick none of them
    with pytest.raises(RouterConfigError):
        Router(DOMAINS, clf, default="cpp", threshold=1.5)


ODD = [
    [],
    [{"role": "user", "content": None}],
    [{"role": "user"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
    [{"role": "user", "content": 42}],
    ["not a dict", None, {"content": "no role"}],
    [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": "oops"}]},
     {"role": "tool", "tool_call_id": "c1", "content": "output"}],
    [{"role": "user", "content": "\x00\udcff émoji 🚀 " * 50}],
    [{"role": "user", "content": "x" * 200_000}],
]


@pytest.mark.parametrize("messages", ODD)
def test_odd_messages_do_not_crash(router: Router, messages: list) -> None:
    d = router.route("auto", messages)
    assert d.specialist in DOMAINS and d.reason in ("classifier", "fallback")
    assert router.route("cpp", messages).specialist == "cpp"


def test_no_text_falls_back(router: Router) -> None:
    d = router.route("auto", [{"role": "user", "content": None}, {"role": "tool", "content": CPP}])
    assert (d.specialist, d.reason, d.scores) == ("python", "fallback", {})
    no_clf = Router(DOMAINS, None, default="shell").route("auto", [{"role": "user", "content": CPP}])
    assert (no_clf.specialist, no_clf.reason) == ("shell", "fallback")


def test_content_parts_and_tool_conversations(router: Router) -> None:
    plain = router.route("auto", [{"role": "user", "content": CPP}])
    parts = router.route("auto", [{"role": "user", "content": [{"type": "text", "text": CPP}, {"type": "image_url"}]}])
    assert parts.specialist == "cpp" and parts.scores == pytest.approx(plain.scores)
    follow_up = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": CPP},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "compile_snippet", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "exit status 0"},
        {"role": "user", "content": "and now with -O2?"},
    ]
    assert router.route("auto", follow_up).specialist == "cpp"


def test_request_parts_weights_and_tool_names() -> None:
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok", "tool_calls": [{"type": "function", "function": {"name": "man_page"}}]},
        {"role": "tool", "content": "TOOL OUTPUT"},
        {"role": "user", "content": [{"type": "text", "text": "last"}]},
    ]
    parts = dict(request_parts(messages, SHELL_TOOLS + [{"name": "bare_fn"}, "junk"]))
    assert parts["last"] == LAST_USER_WEIGHT and parts["first"] == EARLIER_USER_WEIGHT
    assert parts["run_shell man_page bare_fn"] == TOOLS_WEIGHT
    assert "ok" not in parts and "TOOL OUTPUT" not in parts


def test_feature_hashing_is_deterministic_and_normalized() -> None:
    a, b = FeatureHasher(FeatureConfig()), FeatureHasher(FeatureConfig())
    parts = [("std::vector<int> v;", 1.0), ("make all", 0.5)]
    va, vb = a.vectorize(parts), b.vectorize(parts)
    assert np.array_equal(va.index, vb.index) and np.array_equal(va.value, vb.value)
    assert float(np.dot(va.value, va.value)) == pytest.approx(1.0, abs=1e-5)
    assert len(np.unique(va.index)) == len(va.index) and va.index.max() < FeatureConfig().buckets
    # pinned buckets: a changed hash function would silently scramble the shipped weights
    assert a.word_ids("make all").tolist() == [154088, 173553, 58573]  # make, all, (make, all)
    assert a.char_ids("abc").tolist() == [34638]
    assert a.vectorize([]).index.size == 0


def test_load_rejects_missing_or_mismatched_files(tmp_path: Path, clf: ContentClassifier) -> None:
    with pytest.raises(ClassifierFileError):
        ContentClassifier.load(tmp_path)
    meta = json.loads((SHIPPED / META_FILE).read_text())
    meta["labels"] = meta["labels"][:3]
    (tmp_path / META_FILE).write_text(json.dumps(meta))
    (tmp_path / WEIGHTS_FILE).write_bytes((SHIPPED / WEIGHTS_FILE).read_bytes())
    with pytest.raises(ClassifierFileError):
        ContentClassifier.load(tmp_path)


# ------------------------------------------------------------------ a tiny training run

SYNTH = {
    "alpha": lambda r, n: f"proc {n}_{r.randint(0, 99)} :- begin\n    emit <<{n}>> ;;\n    loop ~> {r.randint(0, 9)}\nend.\n",
    "beta": lambda r, n: f"[section.{n}]\nkey_{r.randint(0, 99)} = \"{n}\"\nenabled = yes\n# note about {n}\n",
    "gamma": lambda r, n: f"@@ {n} @@\n+ added {n} line {r.randint(0, 99)}\n- removed {n}\n  context line\n",
}


def _write_synthetic(root: Path, seed: int) -> None:
    r = random.Random(seed)
    words = ["foo", "bar", "baz", "qux", "zap", "lorem", "ipsum", "node", "item", "data"]
    for label, make in SYNTH.items():
        for split, ndocs in (("train", 24), ("validation", 8)):
            docs = ["".join(make(r, r.choice(words)) for _ in range(30)) for _ in range(ndocs)]
            (root / "corpora" / label).mkdir(parents=True, exist_ok=True)
            with open(root / "corpora" / label / f"{split}.jsonl", "w") as f:
                for i, text in enumerate(docs):
                    f.write(json.dumps({"path": f"{label}/{i}", "text": text}) + "\n")
            (root / "chat" / label).mkdir(parents=True, exist_ok=True)
            with open(root / "chat" / label / f"{split}.jsonl", "w") as f:
                for i in range(20):
                    snippet = make(r, r.choice(words))
                    f.write(json.dumps({"messages": [{"role": "user", "content": f"Continue this:\n{snippet}"},
                                                     {"role": "assistant", "content": "ok"}],
                                        "tools": [{"type": "function", "function": {"name": f"{label}_tool"}}]}) + "\n")
    (root / "corpora" / "manifest.json").write_text(json.dumps({"corpus_sha256": "feedface"}))


def test_tiny_training_run_separates_synthetic_domains(tmp_path: Path) -> None:
    _write_synthetic(tmp_path, seed=1)
    args = ["--corpora", str(tmp_path / "corpora"), "--chat", str(tmp_path / "chat"), "--labels", *SYNTH,
            "--epochs", "3", "--buckets-log2", "12", "--chat-per-domain", "20"]
    assert train_main([*args, "--out", str(tmp_path / "a")]) == 0
    assert train_main([*args, "--out", str(tmp_path / "b")]) == 0
    a, b = ContentClassifier.load(tmp_path / "a"), ContentClassifier.load(tmp_path / "b")
    assert np.array_equal(a.weight, b.weight)  # fixed seed: the same weights
    assert a.labels == list(SYNTH) and a.weight.shape == (4096, 3)
    assert a.meta["corpus_sha256"] == "feedface" and a.meta["val_accuracy"] >= 0.9
    assert a.meta["train_accuracy"] >= 0.9 and "chat_sha256" in a.meta and a.meta["date"]
    r = random.Random(99)  # fresh documents with words never seen in training
    router = Router(list(SYNTH), a, default="alpha", threshold=0.0)
    for label, make in SYNTH.items():
        for word in ("unseen", "novel", "other"):
            text = "".join(make(r, word) for _ in range(3))
            assert router.route("auto", [{"role": "user", "content": text}]).specialist == label
