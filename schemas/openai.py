"""OpenAI chat-completions wire format: requests, responses, stream chunks, errors, model list."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.messages import (  # re-exported: the request's message models live there
    ImagePart,
    Message,
    MMProcessorKwargs,
    TextPart,
    Tool,
    ToolChoice,
    VideoPart,
    _Tolerant,
)


class JsonSchemaSpec(_Tolerant):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")  # OpenAI's rule for the name
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(True, alias="schema", description="absent: any JSON value")
    strict: bool = Field(False, description="Accepted; the schema is always enforced (as vLLM does).")


class ResponseFormat(_Tolerant):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return self


class StructuredOutputs(_Tolerant):
    """vLLM's extension (`structured_outputs`, formerly the `guided_*` fields): exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None


class StreamOptions(_Tolerant):
    include_usage: bool = False


class ChatCompletionRequest(_Tolerant):
    model: str | None = Field(None, description="Must name the served model when given.")
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: list[str] = Field(default_factory=list, description="Up to max_stop strings; a string means one.")
    n: int = Field(1, ge=1, description="Choices to generate; at most the server's max_n.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # Extensions, as in vLLM: top_k (0 or -1: off); stop_token_ids; return the prompt and completion token ids
    # (for parity checks and debugging); keep generating past EOS (benchmarks that need exact output lengths).
    top_k: int = Field(0, ge=-1)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    return_token_ids: bool = False
    ignore_eos: bool = False
    context_overflow: Literal["error", "drop_oldest_turns"] | None = Field(
        None, description="Over the context: a 400, or drop the oldest whole turns; default: the server's setting."
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension
    tools: list[Tool] = Field(default_factory=list, max_length=128)
    tool_choice: ToolChoice | None = Field(None, description="default: auto with tools, none without")
    parallel_tool_calls: bool = True
    mm_processor_kwargs: MMProcessorKwargs | None = None  # vLLM's extension: video sampling (fps or nframes, pixels)

    @model_validator(mode="before")
    @classmethod
    def _guided_fields(cls, data: Any) -> Any:
        # NOTE: vLLM's older guided_json / guided_regex / guided_choice / guided_grammar, as structured_outputs
        kinds = ("json", "regex", "choice", "grammar")
        if isinstance(data, dict) and any(data.get(f"guided_{k}") is not None for k in kinds):
            data = {**data, "structured_outputs": {k: data[f"guided_{k}"] for k in kinds if f"guided_{k}" in data}}
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        return [] if v is None else [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV the LLM replica found in its prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut]
    # NOTE: required by OpenAI's schema (nullable), like the message's refusal: typed clients generated from
    # it reject a body without it. We never refuse, so it is always null.
    refusal: None = None


class Box(BaseModel):
    """A grounding box of the answer, in pixels of the request's image `image_index` (0-based, request order)."""

    label: str
    image_index: int
    x1: int
    y1: int
    x2: int
    y2: int


class ResponseFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ResponseToolCall(BaseModel):
    id: str  # call_<24 alphanumerics>
    type: Literal["function"] = "function"
    function: ResponseFunction


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the answer is tool calls alone
    refusal: None = None  # required by OpenAI's schema (nullable); always null: no refusals here
    # Extension: boxes parsed out of a grounding answer (absent when there are none).
    boxes: list[Box] | None = Field(None, exclude_if=lambda v: not v)
    tool_calls: list[ResponseToolCall] | None = Field(None, exclude_if=lambda v: not v)


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)


class ChatCompletion(BaseModel):
    id: str = Field(default_factory=_completion_id)
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = Field(None, exclude_if=lambda v: v is None)  # the backend's configuration
    choices: list[Choice]
    usage: Usage
    prompt_token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)


class FunctionDelta(BaseModel):
    name: str | None = Field(None, exclude_if=lambda v: v is None)  # in a call's first delta
    arguments: str  # a fragment of the JSON text


class ToolCallDelta(BaseModel):
    """OpenAI's streamed call: the first delta of call `index` has its id, type and name, later ones more
    arguments."""

    index: int
    id: str | None = Field(None, exclude_if=lambda v: v is None)
    type: Literal["function"] | None = Field(None, exclude_if=lambda v: v is None)
    function: FunctionDelta


class Delta(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=lambda v: v is None)
    content: str | None = Field(None, exclude_if=lambda v: v is None)
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=lambda v: v is None)
    boxes: list[Box] | None = Field(None, exclude_if=lambda v: not v)  # with the finish chunk, as in the message


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: ChoiceLogprobs | None = Field(None, exclude_if=lambda v: v is None)
    token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = Field(None, exclude_if=lambda v: v is None)
    choices: list[ChunkChoice]
    usage: Usage | None = Field(None, exclude_if=lambda v: v is None)
    prompt_token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vlm-serve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


__all__ = [
    "Box",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "Choice",
    "ChoiceLogprobs",
    "ChunkChoice",
    "Delta",
    "ErrorBody",
    "ErrorDetail",
    "FunctionDelta",
    "ImagePart",
    "JsonSchemaSpec",
    "Message",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "ResponseFormat",
    "ResponseFunction",
    "ResponseMessage",
    "ResponseToolCall",
    "StructuredOutputs",
    "TextPart",
    "Tool",
    "ToolCallDelta",
    "TokenLogprobOut",
    "TopLogprob",
    "Usage",
    "VideoPart",
]
