"""Grammars for a specialist's tokenizer: a request's `GrammarSpec` (specialists/wire.py) compiled with
xgrammar into a `Constraint` that the engine turns into a per-request `spec.grammar.Guide`.

Why xgrammar (0.2.8): on this CPU a mask fill costs a median 1.9 us at a 4,096-token vocabulary and
3.1 us at 49,152 (llguidance 1.9.1: 7.0 / 10.7 us; bench/results/grammar_mask_cpu.jsonl), it rolls a
matcher back by any number of tokens (what speculation needs), and it brings no CUDA package.

Kinds:
  json_object   any JSON object (OpenAI's `{"type": "json_object"}`)
  json_schema   a JSON schema (`{"type": "json_schema", ...}`), objects closed (xgrammar's strict mode: no
                properties or items beyond the schema's, so the output is valid with or without `strict`)
  tool_call     the body of one call, `{"name": <an offered name>, "arguments": <valid for its schema>}`,
                after the `<tool_call>` token: it ends with `</tool_call>` (the engine's tool_close
                trigger) where that is one token, with the literal text and an end of turn otherwise.
                Active from the start when the prompt ends with `<tool_call>` (tool_choice required or a
                named function), else from the first `<tool_call>` the model writes (tool_choice auto).

Output is compact JSON with the separators the chat template uses (", ", ": "): a small model that
may not write whitespace cannot wander in it. Control tokens (<|im_end|>, <tool_call>, ...) and
tokens holding a raw control character (a tab, a newline: never valid in compact JSON) are never text
inside a grammar; the end of turn is allowed once the grammar is complete. `Bounds` (per checkpoint,
cantata.json "serving") narrow unbounded strings, arrays and numbers so that a small model closes its
JSON within a reply's budget.

Schemas come from clients: router/schema_guard.py refuses unsupported keywords and non-local
references before a spec reaches here; here compile time is bounded (`compile_timeout_s`, in a worker
thread) and compiled grammars are kept in an LRU cache keyed by the spec's canonical JSON.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from spec.grammar import Guide
from specialists.chat import TOOL_CALL_CLOSE
from specialists.wire import GrammarSpec

SEPARATORS = (", ", ": ")  # json.dumps' defaults: what the chat template renders
CLOSE_SLACK = 16  # closing starts this many tokens before the schema's smallest instance would no longer fit


class GrammarError(ValueError):
    """A grammar that cannot be compiled (a bad schema, or one over the compile budget): a 400."""


@dataclass(frozen=True)
class Constraint:
    """A compiled grammar for one tokenizer; `new_guide` gives each request its own matcher."""

    compiled: Any  # xgrammar.CompiledGrammar (its compiler's stop tokens end it: an end of turn, or </tool_call>)
    on_tool_open: bool  # a tool call's body: starts at the <tool_call> token
    closers: torch.Tensor | None = None  # [V] float: 2 for tokens of `"]}` that start with a quote, 1 for `]}` only
    min_chars: int = 0  # characters of the smallest reply the grammar allows (an upper bound on its tokens)

    def new_guide(self, in_tool: bool, max_tokens: int | None = None) -> Guide:
        """A request's guide; with max_tokens, it closes its JSON first once the tokens left are within
        CLOSE_SLACK of the smallest reply the grammar allows (spec.grammar.Guide.reserve)."""
        matcher = xgr.GrammarMatcher(self.compiled)  # its stop tokens are its compiler's (never overridden:
        # xgrammar would then let the tokenizer's own stop tokens through as text)
        reserve = 0 if max_tokens is None else min(max_tokens - 1, self.min_chars + CLOSE_SLACK)
        return Guide(matcher, active=not self.on_tool_open or in_tool, activate_on_tool_open=self.on_tool_open,
                     closers=self.closers, reserve=reserve)


SAFE_INTEGER = 2**53 - 1  # JSON numbers every parser reads exactly (RFC 8259, section 6)


@dataclass(frozen=True)
class Bounds:
    """Limits the grammar adds where a schema sets none, so that a small model closes its JSON within a
    reply's budget (a model that repeats itself would otherwise write digits or items until max_tokens).
    Output under them is still valid for the schema: they only narrow it. Integers are always kept to
    JSON's safe range; None leaves a dimension unbounded."""

    max_string: int | None = None  # characters of a string without maxLength / enum / const / pattern / format
    max_items: int | None = None  # items of an array without maxItems
    number_range: float | None = None  # |x| <= this for a number without minimum / maximum (also bounds its digits)


def bounded(schema: Any, bounds: Bounds, depth: int = 0) -> Any:
    """A copy of `schema` with `bounds` added where it has none (subschemas included)."""
    if isinstance(schema, list):
        return [bounded(v, bounds, depth + 1) for v in schema]
    if not isinstance(schema, dict) or depth > 64:
        return schema
    out = {k: (v if k in ("enum", "const", "default", "examples", "required") else
               {n: bounded(x, bounds, depth + 1) for n, x in v.items()} if k in ("properties", "patternProperties", "$defs", "definitions") and isinstance(v, dict)
               else bounded(v, bounds, depth + 1)) for k, v in schema.items()}
    kinds = out.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    free = not any(k in out for k in ("enum", "const", "$ref"))
    if free and "integer" in kinds and "minimum" not in out and "maximum" not in out and "exclusiveMinimum" not in out and "exclusiveMaximum" not in out:
        out.update(minimum=-SAFE_INTEGER, maximum=SAFE_INTEGER)
    if free and "number" in kinds and bounds.number_range is not None and not any(k in out for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        out.update(minimum=-bounds.number_range, maximum=bounds.number_range)
    if free and "string" in kinds and bounds.max_string is not None and not any(k in out for k in ("maxLength", "pattern", "format")):
        out["maxLength"] = max(bounds.max_string, int(out.get("minLength", 0)))
    if free and "array" in kinds and bounds.max_items is not None and "maxItems" not in out:
        out["maxItems"] = max(bounds.max_items, int(out.get("minItems", 0)))
    return out


def min_chars(schema: Any, root: Any = None, depth: int = 0) -> int:
    """Characters of the smallest compact JSON value `schema` allows (required properties only, minItems
    items, minLength characters); local references followed to a depth of 8."""
    root = schema if root is None else root
    if not isinstance(schema, dict) or depth > 8:
        return 2
    if "const" in schema:
        return len(json.dumps(schema["const"], ensure_ascii=False))
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return min(len(json.dumps(v, ensure_ascii=False)) for v in schema["enum"])
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target: Any = root
        for part in [p for p in ref[1:].split("/") if p]:
            target = target.get(part.replace("~1", "/").replace("~0", "~"), {}) if isinstance(target, dict) else {}
        return min_chars(target, root, depth + 1)
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list) and branches:
        return min(min_chars(b, root, depth + 1) for b in branches)
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    sizes = []
    for kind in kinds:
        if kind == "object" or (kind is None and "properties" in schema):
            props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
            req = [k for k in schema.get("required", []) if isinstance(k, str)]
            sizes.append(2 + sum(len(json.dumps(k, ensure_ascii=False)) + 2 + min_chars(props.get(k, {}), root, depth + 1)
                                 for k in req) + 2 * max(0, len(req) - 1))
        elif kind == "array":
            n = int(schema.get("minItems", 0) or 0)
            sizes.append(2 + n * (min_chars(schema.get("items", {}), root, depth + 1) + 2))
        elif kind == "string":
            sizes.append(2 + int(schema.get("minLength", 0) or 0))
        elif kind in ("boolean", "null"):
            sizes.append(4)
        else:  # a number, or no type
            sizes.append(1)
    return min(sizes)


UNROLL_MAX = 256  # more optional characters than this keep the counted form (a chain of 512 compiled in 3.2 s against 1.4 at a 49,152-token vocabulary)
_BOUNDED_STRING = re.compile(r'^(\w+) ::= \(\("\\"" (\w+)\{(\d+), (\d+)\} "\\""\)\)$', re.M)


def unroll_bounded_strings(ebnf: str) -> str:
    """xgrammar's EBNF for a JSON schema with each bounded string (`NAME ::= "\"" CHAR{m, n} "\""`, what
    it prints for minLength / maxLength) rewritten as a chain of rules that carry the closing quote:
    `NAME ::= "\"" CHAR*m UPTO_(n-m)`, `UPTO_k ::= "\"" | CHAR UPTO_(k-1)`, `UPTO_0 ::= "\""`. The language
    is the same, so every mask is (tests/test_grammar_strings.py compares them token by token), but a fill
    no longer walks xgrammar's counted repetition: late in a 16-character string a fill took up to 270 us
    on this CPU (3.9 ms late in a 128-character string at a 49,152-token vocabulary), and 2-13 us so.
    Strings of the same characters and n - m share one chain: each rule of a chain costs compile time
    (~7 ms at a 49,152-token vocabulary), so a chain per string made a tool with several 128-character
    strings compile in up to 8.8 s."""
    bodies = dict(re.findall(r"^(\w+) ::= (.*)$", ebnf, re.M))
    chains: dict[tuple[str, int], str] = {}  # (the characters' rule body, n - m) -> the chain's stem
    extra: list[str] = []

    def chain(mo: re.Match[str]) -> str:
        name, char, least, most = mo.group(1), mo.group(2), int(mo.group(3)), int(mo.group(4))
        if most - least > UNROLL_MAX or char not in bodies:
            return mo.group(0)
        key = (bodies[char], most - least)
        if key not in chains:
            stem = f"{char}_upto"
            while any(n.startswith(stem) for n in bodies):
                stem += "_"
            rules = [f'{stem}{k} ::= "\\""' + (f" | {char} {stem}{k - 1}" if k else "") for k in range(most - least + 1)]
            extra.extend(rules)
            bodies.update((r.split(" ", 1)[0], "") for r in rules)
            chains[key] = stem
        return f'{name} ::= "\\"" ' + " ".join([char] * least + [f"{chains[key]}{most - least}"])

    out = _BOUNDED_STRING.sub(chain, ebnf)
    return out if not extra else out + "\n" + "\n".join(extra) + "\n"


def _unrolled(grammar: Any) -> Any:
    """grammar with its bounded strings as chains (unroll_bounded_strings), or itself if it has none."""
    text = str(grammar)
    unrolled = unroll_bounded_strings(text)
    if unrolled == text:
        return grammar
    try:
        return xgr.Grammar.from_ebnf(unrolled, root_rule_name="root")
    except Exception:  # noqa: BLE001 - the counted form is the same language: only slower
        return grammar


def _literal(text: str) -> str:
    """An EBNF rule matching exactly `text`."""
    return "root ::= " + json.dumps(text, ensure_ascii=False)


class GrammarCompiler:
    """One per engine: `compile(spec)` -> Constraint (cached). Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, end_ids: set[int] | frozenset[int], *,
                 bounds: Bounds = Bounds(), cache_size: int = 128, compile_timeout_s: float = 10.0,
                 max_schema_bytes: int = 65536) -> None:
        """`vocab_size`: the logits' width (masks cover it); `end_ids`: end-of-turn tokens; `bounds`: what
        the grammar adds to schemas that leave strings, arrays or numbers unbounded."""
        self.bounds = bounds
        self.end_ids = tuple(sorted(end_ids))
        encoded = [""] * len(tokenizer)
        for text, i in tokenizer.get_vocab().items():
            if i < len(encoded):
                encoded[i] = text
        control = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        # compact JSON never holds a raw control character (JSON forbids them in strings; xgrammar's string
        # rule lets a tab through): tokens that decode to one are never text either
        texts = [tokenizer.decode([i]) for i in range(len(encoded))]
        raw = {i for i, t in enumerate(texts) if any(ord(ch) < 32 for ch in t)}
        # closing tokens, by preference: a quote first (inside a string only it closes; elsewhere it opens
        # an empty string), then `]` / `}`; nothing with a space (compact JSON has none before a closer)
        self.closers = torch.zeros(vocab_size, dtype=torch.float32)
        for i, t in enumerate(texts):
            if t and set(t) <= set('"]}') and i not in control:
                self.closers[i] = 2.0 if t[0] == '"' else 1.0
        for i in control | raw:
            if i < len(encoded):
                encoded[i] = ""  # xgrammar treats an empty token as special: never text
        close = tokenizer.convert_tokens_to_ids(TOOL_CALL_CLOSE)
        self.tool_close = close if isinstance(close, int) and close in control else None

        def compiler(stops: tuple[int, ...]) -> Any:  # one per set of tokens that end a grammar
            info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=list(stops))
            return info, xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

        self.info, self._compiler = compiler(self.end_ids)  # JSON output: ends at an end of turn
        # a tool call's body: ends at the </tool_call> token (the engine's tool_close trigger)
        self._tool_compiler = compiler((self.tool_close,))[1] if self.tool_close is not None else self._compiler
        self.cache_size, self.timeout_s, self.max_schema_bytes = cache_size, compile_timeout_s, max_schema_bytes
        self._cache: OrderedDict[str, Constraint] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self.hits = self.misses = 0

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def compile(self, spec: GrammarSpec) -> Constraint:
        key = spec.model_dump_json()
        if len(key) > self.max_schema_bytes:
            raise GrammarError(f"the grammar's schemas are {len(key)} bytes; at most {self.max_schema_bytes}")
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        future = self._pool.submit(self._build, spec)
        try:
            made = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise GrammarError(f"the schema took more than {self.timeout_s:g} s to compile") from None
        with self._lock:
            self.misses += 1
            self._cache[key] = made
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return made

    def _schema_grammar(self, schema: dict[str, Any]) -> Any:
        try:
            return xgr.Grammar.from_json_schema(json.dumps(bounded(schema, self.bounds)), any_whitespace=False, separators=SEPARATORS,
                                                strict_mode=True)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError on bad schemas
            raise GrammarError(f"cannot build a grammar for the schema: {exc}") from None

    def _admits(self, compiled: Any, prefix: str = "") -> bool:
        """Whether a reply under `compiled` can go on after `prefix` (some token is allowed): a schema
        such as {"$ref": "#"} compiles to a grammar that allows nothing."""
        matcher = xgr.GrammarMatcher(compiled)
        if prefix and not matcher.accept_string(prefix):
            return False
        words = xgr.allocate_token_bitmask(1, self.info.vocab_size)
        matcher.fill_next_token_bitmask(words)
        return bool(words.any())

    def _build(self, spec: GrammarSpec) -> Constraint:
        made = self._compile(spec)
        if spec.kind != "tool_call" and not self._admits(made.compiled):
            raise GrammarError("the schema admits no JSON value")
        return made

    def _compile(self, spec: GrammarSpec) -> Constraint:
        if spec.kind == "json_object":
            return Constraint(self._compiler.compile_builtin_json_grammar(), False, self.closers, 2)
        if spec.kind == "json_schema":
            grammar = self._schema_grammar(spec.schema_ or {})
            return Constraint(self._compiler.compile_grammar(_unrolled(grammar)), False, self.closers, min_chars(spec.schema_ or {}))
        least = max(len(json.dumps(t.name, ensure_ascii=False)) + 25 + min_chars(t.parameters) for t in spec.tools)
        heads = ['{"name": ' + json.dumps(t.name, ensure_ascii=False) + ', "arguments": ' for t in spec.tools]
        args: list[Any] = []
        for tool in spec.tools:
            try:
                args.append(self._schema_grammar(tool.parameters))
            except GrammarError:
                if tool.strict:
                    raise
                args.append(self._schema_grammar({"type": "object"}))  # best effort, as a non-strict call is
        made = self._tool_body(spec, heads, args, least)
        # arguments that admit no value (a schema like {"$ref": "#"}) show as no token allowed after the
        # call's head: a strict tool's are refused, a non-strict one's become any object (one more compile)
        empty = [i for i, head in enumerate(heads) if not self._admits(made.compiled, head)]
        for i in empty:
            if spec.tools[i].strict:
                raise GrammarError(f"the parameters of {spec.tools[i].name!r} admit no JSON value")
            args[i] = self._schema_grammar({"type": "object"})
        return self._tool_body(spec, heads, args, least) if empty else made

    def _tool_body(self, spec: GrammarSpec, heads: list[str], args: list[Any], least: int) -> Constraint:
        """One call to one of the tools: head, arguments, `}`, then `</tool_call>` (its token, or text)."""
        calls = [xgr.Grammar.concat(xgr.Grammar.from_ebnf(_literal(h)), a, xgr.Grammar.from_ebnf(_literal("}")))
                 for h, a in zip(heads, args)]
        body = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
        if self.tool_close is not None:  # the grammar ends at `}`; then only the </tool_call> token
            return Constraint(self._tool_compiler.compile_grammar(_unrolled(body)), spec.activate_on_tool_open, self.closers, least)
        body = xgr.Grammar.concat(body, xgr.Grammar.from_ebnf(_literal(TOOL_CALL_CLOSE)))
        return Constraint(self._compiler.compile_grammar(_unrolled(body)), spec.activate_on_tool_open, self.closers,
                          least + len(TOOL_CALL_CLOSE))

    def stats(self) -> dict[str, int]:
        return {"grammar_cache_hits": self.hits, "grammar_cache_misses": self.misses, "grammar_cache_size": len(self._cache)}
