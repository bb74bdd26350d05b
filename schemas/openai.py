"""OpenAI chat-completions wire format: requests, responses, stream chunks, errors, model list."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from schemas.messages import (  # re-exported: the request's message models live there
    ImagePart,
    Message,
    MMProcessorKwargs,
    TextPart,
    Tool,
    ToolChoice,
    VideoPart,
)
from schemas.requests import (  # re-exported: the fields chat shares with text completions live there
    GenerationRequest,
    JsonSchemaSpec,
    ResponseFormat,
    StreamOptions,
    StructuredOutputs,
)


class ChatCompletionRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    context_overflow: Literal["error", "drop_oldest_turns"] | None = Field(
        None, description="Over the context: a 400, or drop the oldest whole turns; default: the server's setting."
    )
    tools: list[Tool] = Field(default_factory=list, max_length=128)
    tool_choice: ToolChoice | None = Field(None, description="default: auto with tools, none without")
    parallel_tool_calls: bool = True
    mm_processor_kwargs: MMProcessorKwargs | None = None  # vLLM's extension: video sampling (fps or nframes, pixels)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


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
    "GenerationRequest",
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
    "StreamOptions",
    "StructuredOutputs",
    "TextPart",
    "Tool",
    "ToolCallDelta",
    "TokenLogprobOut",
    "TopLogprob",
    "Usage",
    "VideoPart",
]
