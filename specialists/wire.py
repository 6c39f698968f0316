"""The wire schemas between the router and a specialist: `GenerateRequest` (router -> specialist) and
`GenerateEvent` (each item of the specialist's stream back). Pydantic only, no torch: the router's
HTTP side imports this module and never loads torch; `specialists.deployment` builds the engine's
sampling parameters from a request."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ToolGrammar(BaseModel):
    """One offered function: its name and (repaired, checked) parameters schema."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = False  # a schema the grammar cannot build is a 400 (strict) or any JSON object (not)


class GrammarSpec(BaseModel):
    """What the output must follow (specialists/grammar.py compiles it for the specialist's tokenizer):
    `json_object`, `json_schema` (`schema_`), or `tool_call` (one call to one of `tools`, its body
    after `<tool_call>`; `activate_on_tool_open`: only once the model opens a call)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    kind: Literal["json_object", "json_schema", "tool_call"]
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    tools: list[ToolGrammar] = Field(default_factory=list)
    activate_on_tool_open: bool = False


class GenerateRequest(BaseModel):
    """What the router sends a specialist: the rendered prompt and sampling settings."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1)
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    grammar: GrammarSpec | None = None  # constrained decoding (tool calls, response_format)
    trace_context: dict[str, str] = Field(default_factory=dict)


class GenerateEvent(BaseModel):
    """One item of a specialist's stream (sent as a dict through the Serve handle).

    start: admitted, `speculation` is the gate's status at admission;
    text: `text` is new text, `completion_tokens` the tokens so far, `speculation` so far;
    end: `finish_reason`, `speculation` (what the request used), token counts, engine `stats`;
    error: `status` (400 bad request, 503 not ready, 500 engine error) and `message`.
    """

    type: Literal["start", "text", "end", "error"]
    specialist: str
    text: str = ""
    speculation: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    stats: dict[str, Any] = Field(default_factory=dict)
    status: int = 0
    message: str = ""
