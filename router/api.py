"""OpenAI-compatible request, response and error schemas (pydantic v2), and the typed errors the
HTTP layer turns into OpenAI's error shape: {"error": {"message", "type", "param", "code"}}.

Requests ignore fields they do not know (the official client sends new fields over time); fields
that change the meaning of a request and are not supported (n > 1, logprobs, logit_bias, penalties,
response_format, ...: router/request_guard.py) are refused with 400 by name. Types are strict.
Responses carry a few extra fields, which the openai client keeps as extras:
`message.tool_call_errors` (tool calls whose arguments do not fit the tool's schema), and on the
final streamed chunk `speculation` (what the request actually used).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

import json

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, field_validator, model_validator

# ---- errors --------------------------------------------------------------------------------------


class APIError(Exception):
    """An error with an HTTP status and OpenAI's error fields."""

    status_code: int = 400
    error_type: str = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.error_type, param=self.param,
                                               code=self.code)).model_dump()


class BadRequestError(APIError):
    status_code = 400


class AuthenticationError(APIError):
    status_code = 401
    error_type = "authentication_error"


class NotFoundError(APIError):
    status_code = 404
    error_type = "not_found_error"


class UnprocessableError(APIError):
    status_code = 422


class ServiceUnavailableError(APIError):
    status_code = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: int = 5, code: str | None = "not_ready") -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(retry_after_s)})


class InternalError(APIError):
    status_code = 500
    error_type = "internal_error"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ---- requests ------------------------------------------------------------------------------------


class FunctionDefinition(BaseModel):
    """A tool's function. Only `name` is required; `parameters` may be any JSON object (quirks
    such as `"type": "dict"` are repaired in router/tools.py, not rejected here)."""

    model_config = ConfigDict(extra="ignore")  # unknown keys are dropped, not kept: nobody reads them

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters", mode="before")
    @classmethod
    def _parameters_text(cls, v: Any) -> Any:
        """Some clients send the schema as JSON text."""
        if isinstance(v, str):
            try:
                return json.loads(v)
            except ValueError:
                raise ValueError("parameters is a string that is not a JSON object") from None
        return v


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown keys are dropped, not kept: nobody reads them

    type: Literal["function"] = "function"
    function: FunctionDefinition

    @model_validator(mode="before")
    @classmethod
    def _bare_function(cls, data: Any) -> Any:
        """A bare function dict ({"name", "parameters", ...}) is wrapped, as the chat template does."""
        if isinstance(data, dict) and "function" not in data and "name" in data:
            return {"type": "function", "function": data}
        return data


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown keys are dropped, not kept: nobody reads them

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] | None = None  # a JSON string per OpenAI; a dict is tolerated


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown keys are dropped, not kept: nobody reads them

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


PART_KEYS = ("type", "text", "refusal")


class ChatMessage(BaseModel):
    """One input message. Content is a string, None, or a list of content parts."""

    model_config = ConfigDict(extra="ignore")  # unknown keys are dropped, not kept: nobody reads them

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _part_keys(cls, v: Any) -> Any:
        """Content parts keep only the keys anything reads (router/tools.py content_text)."""
        if isinstance(v, list):
            return [{k: p[k] for k in PART_KEYS if k in p} if isinstance(p, dict) else p for p in v]
        return v


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown keys are dropped, not kept: nobody reads them

    include_usage: StrictBool = False


# Counted before anything is validated (pydantic checks a list's max_length only after validating every
# item, on the router's event loop: 100k tiny messages took 5 s, 50k tool calls 9 s).
MAX_MESSAGES = 4096
MAX_MESSAGE_ITEMS = 8192  # messages + their content parts + their tool calls, all messages together
MAX_TOOLS_PARSED = 1024  # a ceiling before validation; RequestLimits.max_tools (default 128) is the real limit


def _count_items(data: Any) -> None:
    """Refuse, before validation, requests whose messages or tools are too many to validate cheaply."""
    if not isinstance(data, dict):
        return
    messages, tools = data.get("messages"), data.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS_PARSED:
        raise ValueError(f"tools: {len(tools)} tools; at most {MAX_TOOLS_PARSED}")
    if not isinstance(messages, list):
        return
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"messages: {len(messages)} messages; at most {MAX_MESSAGES}")
    items = len(messages)
    for m in messages:
        if isinstance(m, dict):
            items += sum(len(m[k]) for k in ("content", "tool_calls") if isinstance(m.get(k), list))
    if items > MAX_MESSAGE_ITEMS:
        raise ValueError(f"messages: {items} messages, content parts and tool calls; at most {MAX_MESSAGE_ITEMS}")
StrictFloat = Annotated[float, Strict()]  # a JSON number (an integer is a number too); never a string


class ChatCompletionRequest(BaseModel):
    """A chat request. Types are strict (`"stream": "yes"`, `"temperature": "0.5"`, `"max_tokens": true`
    are refused, not coerced). Unknown fields are dropped (and so cost nothing later), except the
    ones router/request_guard.py refuses by name: the fields from `top_logprobs` down are declared
    so that they are checked, and are refused unless they ask for the default."""

    model_config = ConfigDict(extra="ignore")  # unknown keys are dropped, not kept: nobody reads them

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=0)  # extension (vLLM style)
    seed: StrictInt | None = None  # range checked in request_guard (a 400 naming seed)
    stop: str | list[str] | None = None
    n: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = None
    user: str | None = None
    # accepted only at their defaults (router/request_guard.py)
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    logit_bias: dict[str, StrictFloat] | None = None
    presence_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: StrictFloat | None = Field(None, gt=0.0)
    min_p: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    response_format: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    best_of: StrictInt | None = Field(None, ge=1)
    echo: StrictBool | None = None
    guided_json: Any = None  # vLLM's guided decoding: refused
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        _count_items(data)
        return data

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---- responses -----------------------------------------------------------------------------------


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ToolCallError(BaseModel):
    """A tool call whose arguments are not valid for the tool (or that did not parse at all)."""

    index: int  # position among the reply's tool calls (-1 when it is not in tool_calls)
    name: str | None
    error: str
    raw: str


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None
    tool_call_errors: list[ToolCallError] | None = None


FinishReason = Literal["stop", "length", "tool_calls"]


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cantata"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
