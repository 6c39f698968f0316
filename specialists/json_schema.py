"""JSON-schema validation of tool-call arguments, treating the schema as untrusted data.

Tool schemas come from API clients, so validating against one must neither reach outside the
schema nor run unbounded:

* references resolve only inside the schema (`#/...`): the validator's registry has a `retrieve`
  that refuses every URI, so no file is read and no URL is fetched, whatever the `$ref`, `$id`
  or `$schema` says (jsonschema's default registry would urlopen any scheme);
* `pattern` and `patternProperties` run on the `regex` package with a timeout (it releases the GIL
  while matching), not on `re`, whose backtracking is unbounded;
* one validation has a budget: a deadline and a cap on how many references it may follow, so
  a schema whose local references fan out exponentially gives up instead of running for hours.

No torch here; `specialists.chat.validate_arguments` and the router use `validate_with_budget`.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jsonschema
import referencing
import referencing.exceptions
import regex

PATTERN_TIMEOUT_S = 0.1  # one pattern match
VALIDATION_TIMEOUT_S = 0.5  # one whole validation
MAX_REFERENCES = 10_000  # references followed in one validation
REF_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")
DATA_KEYWORDS = ("enum", "const", "default", "examples")  # values here are data, not schemas


class SchemaBudgetExceeded(RuntimeError):
    """Validation took longer, or followed more references, than its budget allows."""


@dataclass
class _Budget:
    deadline: float  # time.monotonic()
    references_left: int

    def remaining_s(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise SchemaBudgetExceeded("checking the arguments against the schema took too long")
        return left


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("cantata_schema_budget", default=None)


def _refuse(uri: str) -> referencing.Resource:
    raise referencing.exceptions.NoSuchResource(ref=uri)


# Every schema gets its own registry view (`registry=` below); nothing is ever retrieved.
_REFUSING = referencing.Registry(retrieve=_refuse)  # type: ignore[call-arg]


def _search(pattern: str, text: str) -> bool:
    budget = _BUDGET.get()
    timeout = PATTERN_TIMEOUT_S if budget is None else min(PATTERN_TIMEOUT_S, budget.remaining_s())
    try:
        return regex.search(pattern, text, timeout=timeout, concurrent=True) is not None
    except TimeoutError:
        raise SchemaBudgetExceeded(f"the pattern {pattern[:80]!r} took longer than {timeout:.2f} s to match") from None


def _pattern(validator: Any, patrn: str, instance: Any, schema: Any) -> Iterator[jsonschema.ValidationError]:
    if validator.is_type(instance, "string") and not _search(patrn, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {patrn!r}")


def _pattern_properties(validator: Any, patterns: Mapping[str, Any], instance: Any,
                        schema: Any) -> Iterator[jsonschema.ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for patrn, subschema in patterns.items():
        for key, value in instance.items():
            if _search(patrn, key):
                yield from validator.descend(value, subschema, path=key, schema_path=patrn)


def _counted(keyword_fn: Any) -> Any:
    def follow(validator: Any, ref: Any, instance: Any, schema: Any) -> Iterator[jsonschema.ValidationError]:
        budget = _BUDGET.get()
        if budget is not None:
            budget.remaining_s()
            budget.references_left -= 1
            if budget.references_left < 0:
                raise SchemaBudgetExceeded(f"the schema's references expand past {MAX_REFERENCES} steps")
        yield from keyword_fn(validator, ref, instance, schema)

    return follow


@lru_cache(maxsize=None)
def _safe_class(base: type) -> type:
    """`base` (a draft's validator class) with bounded pattern matching and counted references."""
    keywords: dict[str, Any] = {}
    if "pattern" in base.VALIDATORS:
        keywords["pattern"] = _pattern
    if "patternProperties" in base.VALIDATORS:
        keywords["patternProperties"] = _pattern_properties
    for key in REF_KEYWORDS:
        if key in base.VALIDATORS:
            keywords[key] = _counted(base.VALIDATORS[key])
    return jsonschema.validators.extend(base, keywords)


def outside_references(schema: Any, path: str = "") -> list[tuple[str, str]]:
    """(path, value) of every reference keyword in `schema` that does not point inside it
    (a local reference is a string starting with '#'). Values of enum/const/default/examples
    are data and are not looked into."""
    found: list[tuple[str, str]] = []
    stack: list[tuple[Any, str]] = [(schema, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, Mapping):
            for key, value in node.items():
                here = f"{where}.{key}" if where else str(key)
                if key in REF_KEYWORDS and isinstance(value, str):
                    if not value.startswith("#"):
                        found.append((here, value))
                elif key in REF_KEYWORDS and not isinstance(value, Mapping):
                    found.append((here, repr(value)[:80]))
                elif key not in DATA_KEYWORDS:
                    stack.append((value, here))
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(node))
    return found


def validate_with_budget(arguments: Any, schema: Mapping[str, Any], timeout_s: float = VALIDATION_TIMEOUT_S) -> str | None:
    """Validate `arguments` against `schema`; an error message, or None when they are valid.

    Raises SchemaBudgetExceeded when the budget runs out; jsonschema's SchemaError for an invalid
    schema; a referencing error (wrapped by jsonschema) for a reference that does not resolve."""
    outside = outside_references(schema)
    if outside:
        where, ref = outside[0]
        return f"invalid schema: {where} refers outside the schema ({ref[:80]}); only '#/...' references are allowed"
    base = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    base.check_schema(schema)
    token = _BUDGET.set(_Budget(time.monotonic() + timeout_s, MAX_REFERENCES))
    try:
        validator = _safe_class(base)(schema, registry=_REFUSING)
        error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    finally:
        _BUDGET.reset(token)
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where}: {error.message}" if where else error.message
