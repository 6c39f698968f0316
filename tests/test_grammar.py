"""Grammar-constrained decoding (spec/grammar.py, specialists/grammar.py) under speculation.

* greedy constrained output with speculation equals it without, on a Llama (shell) and a Bamba
  hybrid (cpp) specialist, and every output is valid for its schema;
* the drafter proposes under the mask: every draft a step verifies is one the grammar accepts;
* after every step a guided sequence's grammar state is the state of exactly its kept tokens
  (drafts rolled back), also when an oracle's random drafts are mostly rejected;
* rejection sampling with a mask stays lossless w.r.t. the masked target (chi-square);
* sampled constrained output is valid; compiled grammars are cached and their compile time bounded;
* the router refuses unsupported schema features and outside references by name.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import xgrammar as xgr

from policies.policy import SpeculationPolicy
from router.api import BadRequestError, ChatCompletionRequest
from router.limits import RequestLimits
from router.tools import plan_tools, response_grammar
from spec.acceptance import accept
from spec.grammar import apply_masks, bitmask_words, unpack_bitmask
from spec.sampling import filtered_probs
from specialists.chat import render
from specialists.engine import Engine
from specialists.grammar import Bounds, GrammarCompiler, GrammarError, bounded
from specialists.sampling import SamplingParams
from specialists.telemetry import decode_attributes
from specialists.wire import GrammarSpec, ToolGrammar
from tests.test_acceptance import N, Q, TARGET, V, chi2_pvalue

SCHEMA = {"type": "object", "properties": {
    "command": {"type": "string"}, "count": {"type": "integer"}, "verbose": {"type": "boolean"},
    "paths": {"type": "array", "items": {"type": "string"}}, "mode": {"enum": ["fast", "safe"]}},
    "required": ["command", "count", "mode"]}
QUESTIONS = ["list files sorted by size", "How do I find large files?", "count lines in a file", "show disk usage",
             "compress a directory", "rename all .txt files"]


def _engine(domain: str, mode: str = "on", k: int = 3, **kw) -> Engine:
    return Engine.from_pretrained(f"deploy/models/{domain}", policy=SpeculationPolicy(mode=mode, num_speculative_tokens=k), **kw)


def _prompts(n: int = 6) -> list[str]:
    return [render([{"role": "user", "content": q}], None, True) for q in QUESTIONS[:n]]


def _fresh(engine: Engine, spec: GrammarSpec):
    return engine.grammar(spec).new_guide(True).matcher


@pytest.mark.parametrize("domain,static", [("shell", False), ("cpp", False), ("shell", True), ("cpp", True)])
def test_constrained_greedy_speculation_equals_plain(domain: str, static: bool) -> None:
    """Llama and Bamba; static: the static-batch path (CUDA graphs on a GPU, here eager), where guided
    rows draft through the eager chain under the mask and the verify stays static."""
    spec_engine, plain = _engine(domain, static_batches=static), _engine(domain, mode="off")
    gspec = GrammarSpec(kind="json_schema", schema=SCHEMA)
    outs = {}
    for name, eng in (("spec", spec_engine), ("plain", plain)):
        params = SamplingParams(max_tokens=160, grammar=eng.grammar(gspec))
        outs[name] = eng.generate(_prompts(), params)
    assert [o.token_ids for o in outs["spec"]] == [o.token_ids for o in outs["plain"]]
    assert (spec_engine.runner.static_steps > 0) == static
    m = spec_engine.metrics()
    assert m["grammar_drafts"] > 0 and m["accepted"] > 0 and m["grammar_steps"] > 0 and m["grammar_mask_s"] > 0
    assert 0 <= m["grammar_masked_drafts"] <= m["grammar_drafts"]
    for o in outs["spec"]:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
        # the grammar accepts exactly the output and its end of turn
        matcher = _fresh(spec_engine, gspec)
        assert all(matcher.accept_token(t) for t in o.token_ids) and matcher.is_terminated()
        assert o.stats.grammar_steps > 0
    # what the trace's decode span carries for a constrained request
    attrs = decode_attributes(outs["spec"][0].stats.as_dict(), "on", len(outs["spec"][0].token_ids))
    assert attrs["cantata.grammar_steps"] > 0 and "cantata.grammar_masked_drafts" in attrs and attrs["cantata.grammar_mask_s"] > 0


def test_mask_kernels_match_the_torch_ops() -> None:
    """specialists/ops/grammar_mask.py (Triton's interpreter here) against spec/grammar.py's torch ops:
    the masked logits with the closing bonus on flagged rows, and the masked / unmasked argmax over a
    draft vocabulary (as full-vocabulary ids; a row with nothing allowed gets the first id)."""
    from specialists.ops.grammar_mask import apply_bitmask, masked_argmax

    g = torch.Generator().manual_seed(0)
    V = 3000
    W = bitmask_words(V)
    words = torch.randint(-2**31, 2**31 - 1, (5, W + 1), dtype=torch.int32, generator=g)
    words[:, W] = torch.tensor([0, 1, 0, 1, 0], dtype=torch.int32)
    words[2, :W] = -1
    logits, bonus = torch.randn(5, V, generator=g), torch.rand(V, generator=g) * 1e4
    want = torch.where(unpack_bitmask(words[:, :W], V), logits + bonus * (words[:, W:] != 0), float("-inf"))
    apply_bitmask(logits, words, bonus)
    assert torch.equal(logits, want)
    vocab = torch.randperm(V, generator=g)[:1500].sort().values
    drafter = torch.randn(4, 1500, generator=g)
    bits = words[:4, :W].contiguous()
    bits[3] = 0
    best, free = torch.empty(4, dtype=torch.int64), torch.empty(4, dtype=torch.int64)
    masked_argmax(drafter, bits, vocab, best, free)
    allowed = unpack_bitmask(bits, V)[:, vocab]
    assert best.tolist() == vocab[drafter.masked_fill(~allowed, float("-inf")).argmax(-1)].tolist()
    assert free.tolist() == vocab[drafter.argmax(-1)].tolist() and best[3] == vocab[0]
    assert all(allowed[i, (vocab == best[i]).nonzero()[0, 0]] for i in range(3))


def test_host_mask_path_matches_the_torch_ops() -> None:
    """apply_masks on float32 CPU logits (numpy: unpacked bits, one where) masks exactly what the torch
    ops do (the path of other dtypes and devices), rows and sources in any order, repeats included."""
    g = torch.Generator().manual_seed(1)
    V = 3001
    bits = torch.randint(-2**31, 2**31 - 1, (6, bitmask_words(V)), dtype=torch.int32, generator=g)
    with torch.inference_mode():
        logits = torch.randn(9, V, generator=g)
        fast, ops = logits.clone(), logits.clone().double()
        apply_masks(fast, [0, 3, 4, 8], bits, [5, 1, 1, 0])
        apply_masks(ops, [0, 3, 4, 8], bits, [5, 1, 1, 0])
    assert torch.equal(fast, ops.float())
    assert torch.equal(fast[[1, 2, 5, 6, 7]], logits[[1, 2, 5, 6, 7]])  # other rows untouched
    assert torch.isinf(fast[3]).sum() == V - unpack_bitmask(bits[1:2], V).sum()


def test_a_forced_draft_is_one_allowed_token_of_the_draft_vocabulary() -> None:
    """DraftMasks.forced: the host knows draft j only when every guided row still drafting allows
    exactly one token there, inside the vocabulary and the draft vocabulary; rows not guided or ended
    do not count."""
    from types import SimpleNamespace

    from spec.grammar import DraftMasks

    V = 100
    guide = DraftMasks(SimpleNamespace(rows={0: None, 2: None}, vocab_size=V), [0, 1, 2], 3, None, torch.device("cpu"))
    words = torch.zeros(3, bitmask_words(V), dtype=torch.int32)
    words[0, 1] = 1 << 5  # row 0: token 37 only
    words[1] = -1  # row 1 is not guided: its mask allows all
    words[2, 0] = -(1 << 31)  # row 2: token 31 only (the sign bit)
    assert guide.forced(0, words) == [37, 0, 31]
    allowed = torch.ones(V, dtype=torch.bool).numpy()
    allowed[31] = False
    assert guide.forced(0, words, allowed) is None  # 31 is outside the draft vocabulary
    words[2, 0] |= 1  # row 2 now has a choice
    assert guide.forced(0, words) is None
    guide.counts[2] = 0  # row 2 ended before depth 1: only row 0 counts there
    assert guide.forced(1, words) == [37, 0, 0]
    words[0, 1] = 0
    words[0, 3] = 1 << 10  # token 106: past the vocabulary (a padding bit)
    assert guide.forced(1, words) is None


@pytest.mark.slow
def test_fused_guided_chain_equals_plain(monkeypatch) -> None:
    """The GPU's path, here through Triton's interpreter (slow: one short reply): the drafter's static
    chain a graph per depth with the grammar's masked argmax on the device (specialists/drafter_guided.py),
    the target's masks applied by one kernel in both engines (inside the static verify step for the
    speculative one and a static plain one, outside for an eager plain one); the same tokens as plain decoding, every
    verified draft one the grammar accepts, and the reply closes within its budget."""
    from specialists import drafter_guided
    from specialists.ops.grammar_mask import apply_bitmask

    spec_engine = _engine("shell", static_batches=True, fused_drafter=True, grammar_bounds={})
    plain = _engine("shell", mode="off", grammar_bounds={})
    plain_static = _engine("shell", mode="off", grammar_bounds={}, static_batches=True, fused_drafter=True)
    assert spec_engine.drafter.chains_in_pool
    spec_engine.speculator.mask_kernel = plain.speculator.mask_kernel = apply_bitmask
    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
    gspec = GrammarSpec(kind="json_schema", schema=schema)
    outs = {name: eng.generate(_prompts(1), SamplingParams(max_tokens=24, grammar=eng.grammar(gspec)))[0]
            for name, eng in (("spec", spec_engine), ("plain", plain), ("plain_static", plain_static))}
    assert outs["spec"].token_ids == outs["plain"].token_ids == outs["plain_static"].token_ids
    assert spec_engine.drafter.__dict__.get("_guided")  # the guided chain's buffers: it ran
    assert spec_engine.runner.masked_steps > 0 and plain.runner.masked_steps == 0  # masks in the verify step
    assert plain_static.runner.masked_steps > 0  # and in a plain static decode step
    m = spec_engine.metrics()
    assert m["grammar_drafts"] > 0 and m["accepted"] > 0 and m["grammar_masked_drafts"] > 0
    assert outs["spec"].finish_reason == "stop", outs["spec"].text
    jsonschema.validate(json.loads(outs["spec"].text), schema)
    # depths whose mask allows one token are not read (the host knows the draft); reading every depth
    # drafts the same, and counts the same drafts and mask-changed drafts
    assert spec_engine.drafter.guided_unread > 0
    every = _engine("shell", static_batches=True, fused_drafter=True, grammar_bounds={})
    every.speculator.mask_kernel = apply_bitmask
    monkeypatch.setattr(drafter_guided, "SKIP_FORCED", False)
    out = every.generate(_prompts(1), SamplingParams(max_tokens=24, grammar=every.grammar(gspec)))[0]
    assert out.token_ids == outs["spec"].token_ids and every.drafter.guided_unread == 0
    keys = ("drafted", "accepted", "grammar_drafts", "grammar_masked_drafts", "steps")
    assert {x: every.metrics()[x] for x in keys} == {x: m[x] for x in keys}


@pytest.mark.parametrize("domain", ["shell", "cpp"])
def test_json_closes_within_a_tight_budget(domain: str) -> None:
    """No bounds (grammar_bounds {}), strings and arrays left open, 40 tokens: the toys would repeat
    themselves inside a string until max_tokens; near the budget's end the closing tokens come first,
    so every reply is complete valid JSON, and speculation still gives the same tokens."""
    schema = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}},
                                               "title": {"type": "string"}}, "required": ["notes", "title"]}
    gspec = GrammarSpec(kind="json_schema", schema=schema)
    outs = {}
    for mode in ("on", "off"):
        eng = _engine(domain, mode=mode, grammar_bounds={})
        outs[mode] = eng.generate(_prompts(), SamplingParams(max_tokens=40, grammar=eng.grammar(gspec)))
    assert [o.token_ids for o in outs["on"]] == [o.token_ids for o in outs["off"]]
    for o in outs["on"]:
        assert o.finish_reason == "stop" and len(o.token_ids) <= 40, o.text
        jsonschema.validate(json.loads(o.text), schema)


def test_drafts_are_proposed_under_the_mask_and_the_grammar_is_rolled_back() -> None:
    """Every verified draft is one the grammar accepts at its place; after each step the matcher's
    next-token mask equals that of a fresh matcher fed exactly the kept tokens."""
    engine = _engine("shell", k=4)
    gspec = GrammarSpec(kind="json_schema", schema=SCHEMA)
    params = SamplingParams(max_tokens=120, grammar=engine.grammar(gspec))
    orig = engine.speculator._draft
    checked = []

    def spy(seqs, kmax, guide=None):
        drafts, counts = orig(seqs, kmax, guide) if guide is not None else orig(seqs, kmax)
        for i, seq in enumerate(seqs):
            if seq.guide is not None and seq.guide.active:
                m = seq.guide.matcher.fork()  # rolled back already: the committed state
                ok = [m.accept_token(t) for t in drafts[i, :counts[i]].tolist()]
                checked.append(all(ok))
        return drafts, counts

    engine.speculator._draft = spy
    rids = [engine.add_request(p, params) for p in _prompts(4)]
    words = bitmask_words(engine.speculator.vocab_size)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        for seq in engine.scheduler.running:
            if seq.guide is None or not seq.guide.active:
                continue
            fresh = _fresh(engine, gspec)
            assert all(fresh.accept_token(t) for t in seq.output_ids)
            a, b = torch.zeros(1, words, dtype=torch.int32), torch.zeros(1, words, dtype=torch.int32)
            seq.guide.matcher.fill_next_token_bitmask(a)
            fresh.fill_next_token_bitmask(b)
            assert torch.equal(a, b), f"step {steps}: the grammar is not at the committed tokens"
    assert rids and checked and all(checked)


def test_masked_rejection_sampling_is_lossless() -> None:
    """The verify rows masked by a grammar (apply_masks), drafts sampled from the masked drafter
    distribution: the emitted tokens follow the masked, renormalised target."""
    allowed = torch.tensor([[1, 1, 0, 1, 1, 0, 1, 0], [0, 1, 1, 0, 1, 0, 0, 1], [1, 0, 1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    bits = torch.zeros(3, 1, dtype=torch.int32)
    for j in range(3):
        for t in range(V):
            if allowed[j, t]:
                bits[j, 0] |= 1 << t
    assert torch.equal(unpack_bitmask(bits, V), allowed)
    rows = torch.cat([TARGET, TARGET[:1]]).clone()  # K = 2: rows 0..2
    apply_masks(rows, [0, 1, 2], bits)
    p = filtered_probs(rows, 0.8, 0, 1.0)
    assert (p[~allowed] == 0).all()
    q = Q * allowed[:2]
    q = q / q.sum(-1, keepdim=True)
    gen = torch.Generator().manual_seed(11)
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=gen) for j in range(2)], 1)
    logits = rows[None].expand(N, 3, V).contiguous()
    out = accept(logits, drafts, torch.full((N,), 2), [SamplingParams(temperature=0.8)] * N, ["rejection"] * N,
                 [gen] * N, draft_probs=q[None].expand(N, 2, V).contiguous())
    assert chi2_pvalue(out.tokens[:, 0], p[0]) > 1e-3
    kept = out.num_accepted >= 1
    assert chi2_pvalue(out.tokens[kept, 1], p[1]) > 1e-3
    # and the test has power: the unmasked target is rejected
    unmasked = filtered_probs(torch.cat([TARGET, TARGET[:1]]), 0.8, 0, 1.0)
    assert chi2_pvalue(out.tokens[:, 0], unmasked[0]) < 1e-6


def test_sampled_constrained_output_is_valid() -> None:
    engine = _engine("python", k=3)
    gspec = GrammarSpec(kind="json_schema", schema=SCHEMA)
    c = engine.grammar(gspec)
    params = [SamplingParams(max_tokens=160, temperature=1.0, seed=s, grammar=c) for s in range(6)]
    outs = engine.generate(_prompts(), params)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert engine.metrics()["grammar_drafts"] > 0


def test_tool_call_grammar_offers_only_the_tools(tmp_path) -> None:
    """tool_choice required: the call names an offered tool, its arguments valid for its schema, and it
    ends at </tool_call> (the engine's tool_close trigger: finish_reason tool_calls)."""
    engine = _engine("shell")
    tools = [ToolGrammar(name="weather.get", parameters={"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}),
             ToolGrammar(name="calc", parameters={"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]})]
    c = engine.grammar(GrammarSpec(kind="tool_call", tools=tools))
    prompts = [p + "<tool_call>" for p in _prompts(4)]
    for o in engine.generate(prompts, SamplingParams(max_tokens=120, grammar=c)):
        assert o.finish_reason == "tool_calls", o.text
        body = json.loads(o.text.removesuffix("</tool_call>"))
        schema = {t.name: t.parameters for t in tools}[body["name"]]
        jsonschema.validate(body["arguments"], schema)


def test_compiled_grammars_are_cached_and_bounded() -> None:
    engine = _engine("build", mode="off")
    spec = GrammarSpec(kind="json_schema", schema=SCHEMA)
    a, b = engine.grammar(spec), engine.grammar(spec)
    assert a is b and engine.metrics()["grammar_cache_hits"] == 1
    slow = GrammarCompiler(engine.tokenizer, engine.speculator.vocab_size, engine.eos_ids, compile_timeout_s=1e-4)
    many = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 200} for i in range(30)}}
    with pytest.raises(GrammarError, match="to compile"):
        slow.compile(GrammarSpec(kind="json_schema", schema=many))
    with pytest.raises(GrammarError, match="bytes"):
        GrammarCompiler(engine.tokenizer, engine.speculator.vocab_size, engine.eos_ids, max_schema_bytes=100).compile(
            GrammarSpec(kind="json_schema", schema=many))


def test_a_grammar_with_no_way_on_ends_its_request_not_the_engine() -> None:
    """{"$ref": "#"} admits nothing: refused when compiled. A schema that dead-ends mid-reply (a value
    whose rule is only itself) ends that request with finish_reason grammar_error; the engine and the
    request beside it go on."""
    engine = _engine("shell")
    with pytest.raises(GrammarError, match="admits no JSON value"):
        engine.grammar(GrammarSpec(kind="json_schema", schema={"$ref": "#"}))
    dead = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
            "$defs": {"x": {"$ref": "#/$defs/x"}}}
    c = engine.grammar(GrammarSpec(kind="json_schema", schema=dead))
    bad, good = engine.generate(_prompts(2), [SamplingParams(max_tokens=40, grammar=c), SamplingParams(max_tokens=40)])
    assert bad.finish_reason == "grammar_error" and bad.text.startswith('{"a": ')
    assert good.finish_reason in ("stop", "length") and len(good.token_ids) > 0
    # a non-strict tool whose parameters admit nothing falls back to any object; a strict one is refused
    tool = ToolGrammar(name="f", parameters={"$ref": "#"})
    assert engine.grammar(GrammarSpec(kind="tool_call", tools=[tool])) is not None
    with pytest.raises(GrammarError):
        engine.grammar(GrammarSpec(kind="tool_call", tools=[ToolGrammar(name="f", parameters={"$ref": "#"}, strict=True)]))


def test_bounds_narrow_only_what_the_schema_leaves_open() -> None:
    b = bounded({"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 3},
                                                   "t": {"type": "string"}, "a": {"type": "array", "minItems": 6},
                                                   "e": {"type": "string", "enum": ["x" * 50]}}}, Bounds(8, 4, 100.0))
    p = b["properties"]
    assert p["n"]["maximum"] == 2**53 - 1 and p["s"]["maxLength"] == 3 and p["t"]["maxLength"] == 8
    assert p["a"]["maxItems"] == 6 and "maxLength" not in p["e"]
    engine = _engine("shell", mode="off")
    tight = GrammarCompiler(engine.tokenizer, engine.speculator.vocab_size, engine.eos_ids, bounds=Bounds(4, 2, None))
    m = tight.compile(GrammarSpec(kind="json_schema", schema={"type": "string"})).new_guide(False).matcher
    assert m.accept_string('"abcd') and not m.accept_string("e")


def _request(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "auto", "messages": [{"role": "user", "content": "hi"}], **body})


def test_router_refuses_unsupported_schema_features_by_name() -> None:
    limits = RequestLimits()
    bad = {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}},
                                            "b": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(BadRequestError) as err:
        response_grammar(_request(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}), limits)
    assert "properties.a.not" in err.value.message and "properties.b.uniqueItems" in err.value.message
    assert err.value.param == "response_format.json_schema.schema"
    with pytest.raises(BadRequestError, match="refers outside"):
        response_grammar(_request(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"$ref": "https://example.com/s.json"}}}), limits)
    with pytest.raises(BadRequestError, match="not supported"):
        response_grammar(_request(response_format={"type": "xml"}), limits)
    assert response_grammar(_request(response_format={"type": "json_object"}), limits).kind == "json_object"
    # a strict function must be enforceable whole; a non-strict one loses the keyword for the grammar only
    from router.request_guard import check_request

    tool = {"type": "function", "function": {"name": "f", "parameters": bad}}
    check_request(_request(tools=[tool], tool_choice="required"), limits)
    plan = plan_tools(_request(tools=[tool], tool_choice="required"))
    assert "not" not in json.dumps(plan.grammar.tools[0].parameters) and "uniqueItems" in json.dumps(plan.schemas["f"])
    strict = {"type": "function", "function": {"name": "f", "strict": True, "parameters": bad}}
    with pytest.raises(BadRequestError, match="uniqueItems"):
        check_request(_request(tools=[strict], tool_choice="required"), limits)


def test_bitmask_layout_matches_xgrammar() -> None:
    bm = xgr.allocate_token_bitmask(2, 70)
    bm.zero_()
    bm[0, 0] = 1 << 5
    bm[1, 2] = 1 << 3  # token 67
    allowed = unpack_bitmask(bm, 70)
    assert allowed[0].nonzero().flatten().tolist() == [5] and allowed[1].nonzero().flatten().tolist() == [67]
