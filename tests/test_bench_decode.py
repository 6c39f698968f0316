"""bench.decode: the result line on the shipped build specialist (a Llama), the results row, and the
refusal without weights; and bench.tool_validity --speed's interleaved row."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.decode import main

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "deploy" / "models" / "build"
PROMPTS = ROOT / "bench" / "data" / "build" / "prompts.jsonl"




def last_json(capsys) -> tuple[dict, str]:
    out = capsys.readouterr().out
    lines = [line for line in out.strip().splitlines() if line.strip()]
    return json.loads(lines[-1]), out


def test_result_line(tmp_path: Path, capsys) -> None:
    results = tmp_path / "results.jsonl"
    rc = main(["--model", str(BUILD), "--prompts", str(PROMPTS), "--limit", "2", "--max-new-tokens", "8",
               "--batch-size", "2", "--results", str(results)])
    assert rc == 0
    result, out = last_json(capsys)
    assert "loaded checkpoint" in out and "model.safetensors" in out  # lesson 1: say which weights ran
    assert {"model", "device", "batch_size", "quantization", "engine_tok_s", "hf_tok_s", "ratio",
            "identical", "hf_prefix_agreement", "prefix_hit_tokens"} <= set(result)
    assert result["prefix_hit_tokens"] == 0 and result["quantization"] == "none"
    assert result["model"] == str(BUILD) and result["device"] == "cpu" and result["batch_size"] == 2
    for key in ("engine_tok_s", "hf_tok_s", "ratio", "identical"):
        assert isinstance(result[key], float), (key, result[key])
    assert result["engine_tok_s"] > 0 and result["hf_tok_s"] > 0
    assert result["ratio"] == pytest.approx(result["engine_tok_s"] / result["hf_tok_s"], rel=1e-2)
    assert result["identical"] == 1.0 and result["hf_prefix_agreement"] == 1.0
    row = json.loads(results.read_text().splitlines()[-1])
    assert row == result  # the printed line is the recorded row
    assert row["bench"] == "decode" and row["identical"] == 1.0 and row["max_new_tokens"] == 8 and row["prompts"] == 2
    assert {"device_name", "commit", "checkpoint", "prompt_tokens", "prefix_hit_tokens"} <= set(row)
    assert row["prefix_hit_tokens"] == 0  # the warm-up must not pre-fill the prefix cache with the timed prompts


def test_int8_quantization_result_line(capsys) -> None:
    """--quantization int8: the result says so, and speculation's tokens equal the plain engine's."""
    rc = main(["--model", str(BUILD), "--prompts", str(PROMPTS), "--limit", "2", "--max-new-tokens", "16",
               "--spec-k", "2", "--quantization", "int8", "--skip-hf"])
    assert rc == 0
    result, _ = last_json(capsys)
    assert result["quantization"] == "int8" and result["identical_spec"] == 1.0 and result["engine_tok_s"] > 0


def test_refuses_without_weights(tmp_path: Path, capsys) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy2(BUILD / name, bare / name)
    assert main(["--model", str(bare), "--prompts", str(PROMPTS), "--limit", "1"]) == 2
    assert "model.safetensors" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["--model", str(empty), "--prompts", str(PROMPTS), "--limit", "1"]) == 2


def test_spec_result_line(tmp_path: Path, capsys) -> None:
    """--spec-k adds the speculative engine's figures, measured side by side in the same run."""
    results = tmp_path / "results.jsonl"
    rc = main(["--model", str(BUILD), "--prompts", str(PROMPTS), "--limit", "3", "--max-new-tokens", "12",
               "--spec-k", "3", "--skip-hf", "--results", str(results)])
    assert rc == 0
    result, _ = last_json(capsys)
    assert {"spec_tok_s", "speedup", "identical_spec", "mean_accepted", "acceptance_by_position"} <= set(result)
    assert result["hf_tok_s"] is None and result["ratio"] is None  # --skip-hf
    assert result["identical_spec"] == 1.0  # greedy speculation is exact
    assert result["speedup"] == pytest.approx(result["spec_tok_s"] / result["engine_tok_s"], rel=1e-2)
    assert len(result["acceptance_by_position"]) == 3 and all(0 <= a <= 1 for a in result["acceptance_by_position"])
    assert result["mean_accepted"] > 0
    row = json.loads(results.read_text().splitlines()[-1])
    assert row["spec_k"] == 3 and row["acceptance"] == "greedy" and row["policy"] == "on"


def test_prefill_graph_tokens_pads_fresh_prompts_and_the_row_says_so(capsys) -> None:
    """--prefill-graph-tokens N: fresh prompts prefill padded (on a GPU as graphs; on the CPU the same
    padded forward), the row records N and how many steps ran so; the CPU's default is 0, every prefill
    eager. Speculative output equals plain output either way."""
    args = ["--model", str(BUILD), "--prompts", str(PROMPTS), "--limit", "2", "--max-new-tokens", "8", "--skip-hf",
            "--spec-k", "2", "--batch-size", "2"]
    assert main(args + ["--prefill-graph-tokens", "512"]) == 0
    padded, _ = last_json(capsys)
    assert padded["prefill_graph_tokens"] == 512 and padded["padded_prefills"] > 0 and padded["identical_spec"] == 1.0
    assert main(args) == 0
    eager, _ = last_json(capsys)
    assert eager["prefill_graph_tokens"] == 0 and eager["padded_prefills"] == 0 and eager["identical_spec"] == 1.0


def test_spec_engine_under_the_auto_policy(tmp_path: Path, capsys) -> None:
    """--policy auto: the speculative engine runs under the gate (a large batch falls back to plain
    steps there), still exact, and the row says which policy ran."""
    results = tmp_path / "results.jsonl"
    assert main(["--model", str(BUILD), "--prompts", str(PROMPTS), "--limit", "3", "--max-new-tokens", "12",
                 "--spec-k", "3", "--skip-hf", "--policy", "auto", "--results", str(results)]) == 0
    result, _ = last_json(capsys)
    assert result["policy"] == "auto" and result["identical_spec"] == 1.0
    assert json.loads(results.read_text().splitlines()[-1])["policy"] == "auto"


def test_repeat_rounds_swap_engines_and_agree(tmp_path: Path, capsys) -> None:
    """--repeat 2 under auto: both engines ran both sides, every round gave the first round's tokens,
    and the row has the later rounds' speed-up and each engine's gate."""
    results = tmp_path / "results.jsonl"
    assert main(["--model", str(BUILD), "--prompts", str(PROMPTS), "--limit", "2", "--max-new-tokens", "10",
                 "--spec-k", "3", "--skip-hf", "--policy", "auto", "--repeat", "2", "--results", str(results)]) == 0
    row = json.loads(results.read_text().splitlines()[-1])
    assert row["repeat"] == 2 and row["repeat_identical"] is True and row["identical_spec"] == 1.0
    assert row["speedup_after_first_round"] > 0 and len(row["gates"]) == 2
    # both engines' timed steps by the gate's decision: the plain side "off", the speculative side not
    times = row["step_times"]
    assert times["off"]["tokens"] == 2 * 2 * 10 and sum(v["tokens"] for k, v in times.items() if k != "off") == 2 * 2 * 10


def test_a_later_round_hits_what_its_own_side_cached(tmp_path: Path, capsys) -> None:
    """An engine keeps its side of a batch in every round: round 2's speculating side hits the blocks
    its own round 1 cached with drafter entries, as the plain side hits its own. When the engines
    swapped sides every round, the speculating side met the plain side's blocks (no drafter entries)
    and computed its prompts again: half of these hits (120 of 261 prompt tokens, against 240)."""
    results = tmp_path / "results.jsonl"
    assert main(["--model", str(BUILD), "--prompts", str(PROMPTS), "--limit", "2", "--max-new-tokens", "10",
                 "--spec-k", "3", "--skip-hf", "--policy", "on", "--repeat", "2", "--results", str(results)]) == 0
    row = json.loads(results.read_text().splitlines()[-1])
    assert row["identical_spec"] == 1.0 and row["repeat_identical"] is True
    assert row["prefix_hit_tokens"] >= 0.8 * row["prompt_tokens"]  # both sides' round 2: every full block


def test_roles_balance_the_engines_and_keep_a_batchs_side() -> None:
    from bench.decode_sides import _role

    for n, repeat in ((4, 2), (5, 2), (6, 3), (1, 2)):
        roles = [[_role(i, r, n) for r in range(repeat)] for i in range(n)]
        if n % 2 == 0:
            assert all(len(set(row)) == 1 for row in roles)  # a batch's side never changes between rounds
        flat = [x for row in roles for x in row]
        assert abs(flat.count(0) - flat.count(1)) <= (n * repeat) % 2  # each engine plain equally often


def test_sides_swap_whole_gates() -> None:
    """Either engine runs either side with a gate of its own for each: the speculating gate comes back
    as it was left (its window, status and verdicts; a policy toggle would restart its window and probe
    again after every swap), the plain one is mode off, and speculative graphs need no toggle."""
    from bench.decode_sides import Sides
    from policies.policy import SpeculationPolicy
    from specialists.engine import Engine

    policy = SpeculationPolicy(mode="auto", num_speculative_tokens=3)
    eng = Engine.from_pretrained(str(BUILD), policy=policy, max_num_seqs=2)
    eng.set_policy(policy.model_copy(update={"mode": "off"}))  # as bench.decode leaves its first engine
    sides = Sides(eng, eng, None, 0, "cpu", 8, policy)
    sides.side(eng, True)
    spec_gate = eng.gate
    assert spec_gate.policy.mode == "auto"
    spec_gate.observe(3, 0)  # something in its window
    with spec_gate._lock:
        spec_gate._enter("fallback", "low_acceptance")
    sides.side(eng, False)
    assert eng.gate is not spec_gate and eng.gate.policy.mode == "off" and eng.gate.decide(1) == "off"
    sides.side(eng, True)
    assert eng.gate is spec_gate and spec_gate.status == "fallback" and spec_gate.reason == "low_acceptance"
    assert spec_gate.snapshot()["window_drafted"] == 3


def test_both_engines_capture_their_graphs_under_the_speculating_policy(monkeypatch) -> None:
    """bench.decode's warm-up captures each engine's graphs under the speculative side's policy: the
    first engine, left at mode off with the default K, captured K=3 graphs where the run verified K=5,
    and the shapes the warm-up never reached were captured inside the timed run (H200, session 30)."""
    from bench.decode_sides import Sides, warm_up
    from policies.policy import SpeculationPolicy
    from specialists.engine import Engine

    policy = SpeculationPolicy(mode="auto", num_speculative_tokens=5, auto={"k_choices": [1, 5]})
    engines = [Engine.from_pretrained(str(BUILD), policy=policy, max_num_seqs=2) for _ in range(2)]
    engines[0].set_policy(SpeculationPolicy(mode="off"))  # as bench.decode leaves its first engine
    seen = []
    monkeypatch.setattr(Engine, "capture_graphs", lambda self, *a, **k: seen.append(
        (self.gate.policy.mode, self.gate.policy.num_speculative_tokens, tuple(self.gate.policy.auto.k_choices))) or 0)
    warm_up(Sides(engines[0], engines[1], None, 0, "cpu", 4, policy), [[[5, 6, 7, 8]]], skip_hf=True)
    assert seen == [("auto", 5, (1, 5))] * 2


def test_the_speedup_interval_brackets_the_run_and_widens_with_noise() -> None:
    """speedup_ci95 over (plain, speculative) pairs: it brackets the summed ratio, is a point when every
    pair has one ratio, is wider when the pairs disagree, and is the same for the same pairs."""
    from bench.decode_sides import speedup_interval

    assert speedup_interval([(1.0, 0.5)]) is None
    assert speedup_interval([(1.0, 0.5)] * 10) == [2.0, 2.0]
    steady = [(1.0 + 0.01 * (i % 3), 1.0) for i in range(40)]
    noisy = [(1.0 + 0.3 * (i % 3), 1.0) for i in range(40)]
    lo, hi = speedup_interval(steady)
    ratio = sum(a for a, _ in steady) / sum(b for _, b in steady)
    assert lo <= ratio <= hi and hi - lo < 0.01
    lo2, hi2 = speedup_interval(noisy)
    assert hi2 - lo2 > 10 * (hi - lo) and speedup_interval(noisy) == [lo2, hi2]


def test_a_spec_row_has_its_pairs_and_interval(tmp_path: Path, capsys) -> None:
    assert main(["--model", str(BUILD), "--prompts", str(PROMPTS), "--limit", "4", "--max-new-tokens", "6", "--batch-size", "1",
                 "--spec-k", "3", "--skip-hf", "--repeat", "2"]) == 0
    row, _ = last_json(capsys)
    lo, hi = row["speedup_ci95"]
    assert row["timed_pairs"] == 8 and lo <= hi and lo > 0


def test_spec_refuses_without_a_drafter(tmp_path: Path, capsys) -> None:
    """Lesson 1: no speculative figures from a checkpoint without trained drafter weights."""
    bare = tmp_path / "nodrafter"
    bare.mkdir()
    for f in BUILD.iterdir():
        if not f.name.startswith("mtp"):
            shutil.copy2(f, bare / f.name)
    assert main(["--model", str(bare), "--prompts", str(PROMPTS), "--limit", "1", "--spec-k", "3", "--skip-hf"]) == 2
    assert "mtp.safetensors" in capsys.readouterr().err


def test_chat_renders_rows_through_the_checkpoints_template(tmp_path: Path, capsys) -> None:
    """--chat: a `prompt` row is one user message and a `messages` row a conversation, both rendered
    with the checkpoint's chat template and the generation prompt (specialists.chat.render is the
    same template's evaluation), kept whole; without --chat a messages-only row is refused clearly."""
    from transformers import AutoTokenizer

    from bench.common import PromptRowError, prompt_text
    from specialists.chat import render

    tok = AutoTokenizer.from_pretrained(str(BUILD))
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which flag makes cmake verbose?"}]
    want = render(convo, add_generation_prompt=True)
    assert prompt_text({"messages": convo}, tok, True) == want
    assert want.endswith("<|im_start|>assistant\n")
    assert prompt_text({"prompt": "hi"}, tok, True) == render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt_text({"prompt": "raw text"}, tok, False) == "raw text"
    with pytest.raises(PromptRowError, match="--chat"):
        prompt_text({"messages": convo}, tok, False)
    rows = tmp_path / "chat.jsonl"
    rows.write_text(json.dumps({"messages": convo}) + "\n" + json.dumps({"prompt": "List the files here."}) + "\n")
    results = tmp_path / "results.jsonl"
    assert main(["--model", str(BUILD), "--prompts", str(rows), "--max-new-tokens", "6", "--chat", "--skip-hf",
                 "--results", str(results)]) == 0
    row = json.loads(results.read_text().splitlines()[-1])
    assert row["chat"] is True and row["prompts"] == 2
    assert row["prompt_tokens"] == sum(len(tok(prompt_text(json.loads(r), tok, True), add_special_tokens=False)["input_ids"])
                                       for r in rows.read_text().splitlines())
    assert main(["--model", str(BUILD), "--prompts", str(rows), "--max-new-tokens", "6", "--skip-hf"]) == 2
    assert "--chat" in capsys.readouterr().err


def test_acceptance_bench_takes_chat_rows(tmp_path: Path, capsys) -> None:
    """bench.acceptance --chat measures on the rendered conversation (a messages-only row works)."""
    from bench.acceptance import main as acceptance_main

    rows = tmp_path / "chat.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "Configure a cmake build in release mode."}]}) + "\n")
    results = tmp_path / "acc.jsonl"
    assert acceptance_main(["--model", str(BUILD), "--prompts", str(rows), "--k", "2", "--max-new-tokens", "12", "--chat",
                            "--results", str(results)]) == 0
    row = json.loads(results.read_text().splitlines()[-1])
    assert row["chat"] is True and row["prompts"] == 1 and row["positions"] > 0
    assert len(row["acceptance_by_depth"]) == 2


def test_grammar_speed_interleaves_the_four_ways(tmp_path: Path, capsys) -> None:
    """bench.tool_validity --speed: every request runs speculative and plain, with the grammar and
    without, in a rotating order, for --repeat rounds that must repeat their tokens; the row has the
    ratio per round and each way's step parts, and speculation's outputs equal plain decoding's."""
    from bench import tool_validity

    results = tmp_path / "speed.jsonl"
    assert tool_validity.main(["--speed", "--mode", "response_format", "--limit", "3", "--max-tokens", "24",
                               "--repeat", "2", "--model", str(ROOT / "deploy" / "models" / "shell"),
                               "--results", str(results)]) == 0
    row = json.loads(results.read_text().splitlines()[-1])
    assert row["interleaved"] is True and row["repeat"] == 2 and len(row["grammar_over_free_by_round"]) == 2
    assert row["identical_spec_free"] == row["identical_spec_grammar"] == 1.0
    assert row["spec_grammar_tokens"] == row["plain_grammar_tokens"] > 0
    assert row["grammar_drafts"] > 0 and row["spec_grammar_mask_us_per_step"] > 0
    for way in ("spec_free", "plain_free", "spec_grammar", "plain_grammar"):
        draft, verify, commit = row[f"{way}_draft_verify_commit_ms"]
        assert 0 < draft + verify + commit <= row[f"{way}_ms_per_step"]
