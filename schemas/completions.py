"""OpenAI's legacy text completions (POST /v1/completions) and vLLM's /tokenize and /detokenize: requests and
responses."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from schemas.messages import Message, MMProcessorKwargs, Tool
from schemas.openai import Usage
from schemas.requests import GenerationRequest, Strict, unsupported

# A prompt as OpenAI's legacy API and vLLM take it: a string, strings, token ids, or lists of token ids.
Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(GenerationRequest):
    prompt: Prompt = Field(description="Each prompt gets n choices, numbered prompt * n + choice, as vLLM does.")
    logprobs: int | None = Field(None, ge=0, le=20, description="The sampled token's logprob and the k most likely.")
    echo: bool = Field(False, description="Prepend the prompt's text to each choice's text.")

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v: Prompt) -> Prompt:
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("a prompt list and each token-id prompt in it must not be empty")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts one by one: a string, or token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """`echo` with `logprobs`: the echoed prompt's tokens get theirs too (vLLM's prompt_logprobs)."""
        return self.logprobs if self.echo else None


class CompletionLogprobs(BaseModel):
    """The legacy format: per token its text, logprob, offset in the choice's text, and a {text: logprob} of the
    most likely tokens with the sampled one (so up to k + 1 entries, as OpenAI documents). With `echo`, the prompt's
    tokens come first, the first of them with null for both (nothing precedes it: OpenAI's legacy API and vLLM)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    text_offset: list[int]
    top_logprobs: list[dict[str, float] | None]

    def __add__(self, later: CompletionLogprobs) -> CompletionLogprobs:
        return CompletionLogprobs(
            tokens=self.tokens + later.tokens,
            token_logprobs=self.token_logprobs + later.token_logprobs,
            text_offset=self.text_offset + later.text_offset,
            top_logprobs=self.top_logprobs + later.top_logprobs,
        )


class CompletionChoice(BaseModel):
    index: int
    text: str
    # NOTE: required by OpenAI's schema (nullable); null in a stream chunk before the choice's last.
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)  # return_token_ids
    prompt_token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)  # as vLLM: per choice


class TextCompletion(BaseModel):
    """A whole completion, and each chunk of a stream (whose `usage` is absent but on the usage chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = Field(None, exclude_if=lambda v: v is None)
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, exclude_if=lambda v: v is None)


class TokenizeRequest(Strict):
    """vLLM's /tokenize: a `prompt` (its ids as /v1/completions takes them), or chat `messages` (the ids that
    /v1/chat/completions generates from, images and videos expanded to their placeholder runs)."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = Field(None, description="prompt only: the tokenizer's BOS (default true)")
    messages: list[Message] | None = Field(None, min_length=1)
    tools: list[Tool] | None = Field(None, max_length=128)
    add_generation_prompt: bool | None = Field(None, description="messages only: default true")
    mm_processor_kwargs: MMProcessorKwargs | None = None  # messages only: video sampling, as chat's

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        chat_only = ("tools", "add_generation_prompt", "mm_processor_kwargs")
        other = chat_only if self.prompt is not None else ("add_special_tokens",)
        for name in other:
            if getattr(self, name) is not None:
                raise unsupported(name, f"{name} goes with {'messages' if self.prompt is not None else 'prompt'}")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


__all__ = [
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "Prompt",
    "TextCompletion",
    "TokenizeRequest",
    "TokenizeResponse",
]
