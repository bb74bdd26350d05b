"""The request fields chat and text completions share (sampling, output format, streaming), and which fields a
request may carry at all: every other one is a 400 `unsupported_parameter`, never silently ignored."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from schemas.errors import InvalidRequest
from schemas.messages import _Tolerant
from schemas.sampling import SamplingFields

# Fields OpenAI clients send routinely that change nothing in the tokens of the answer: accepted and ignored, as
# vLLM accepts them. (`service_tier` picks OpenAI's latency tier; `store`, `metadata` and `user` ask OpenAI to keep or
# tag the completion; `prompt_cache_key` and `safety_identifier` are hints for OpenAI's cache and abuse checks.)
NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})


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


_GUIDED = ("json", "regex", "choice", "grammar")


def unsupported(param: str, why: str = "this server does not honour it (docs/api.md lists those it does)"):
    """A pydantic error naming `param` in its context (parse() makes it the error's `param`): raise it from a
    model validator, whose errors have no location of their own."""
    return PydanticCustomError("unsupported_parameter", "unsupported parameter: {why}", {"param": param, "why": why})


class Strict(_Tolerant):
    """A request model that refuses, by name, a top-level field it neither declares nor lists in ACCEPTED (a null
    counts as absent). Its nested objects stay tolerant: clients send back the messages we answered, fields and all."""

    ACCEPTED: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _only_known_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = cls.known_fields()
            for name, value in data.items():
                if value is not None and name not in known:
                    raise unsupported(str(name))
        return data

    @classmethod
    @functools.cache
    def known_fields(cls) -> frozenset[str]:
        return frozenset({f.alias or name for name, f in cls.model_fields.items()} | cls.ACCEPTED)


class GenerationRequest(Strict, SamplingFields):
    """What POST /v1/chat/completions and POST /v1/completions share; the sampling fields are SamplingFields'
    (schemas/sampling.py)."""

    # Beside the declared fields: vLLM's older spellings of structured_outputs, and the list above.
    ACCEPTED: ClassVar[frozenset[str]] = frozenset(f"guided_{k}" for k in _GUIDED) | NO_EFFECT

    model: str | None = Field(None, description="Must name the served model when given.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, description="Choices to generate; at most the server's max_n.")
    # vLLM's extension: return the prompt and completion token ids (for parity checks and debugging).
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension
    cache_salt: str | None = Field(None, min_length=1, max_length=256, description="vLLM's: scopes the caches")

    @model_validator(mode="before")
    @classmethod
    def _guided_fields(cls, data: Any) -> Any:
        # NOTE: vLLM's older guided_json / guided_regex / guided_choice / guided_grammar, as structured_outputs
        if isinstance(data, dict) and any(data.get(f"guided_{k}") is not None for k in _GUIDED):
            data = {**data, "structured_outputs": {k: data[f"guided_{k}"] for k in _GUIDED if f"guided_{k}" in data}}
        return data

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """None: no logprobs; k: the sampled token's logprob and the k most likely (0 to 20)."""
        raise NotImplementedError

    @property
    def num_prompt_logprobs(self) -> int | None:
        """None: the prompt's logprobs are not asked for; k: each prompt token's and the k most likely."""
        return None


@dataclass(frozen=True, slots=True)
class ChatForm:
    """A request of another API (Responses, Messages) as chat's JSON body, with where each of chat's fields came from
    in the client's request, so that a 4xx from chat's checks names the field the client sent."""

    body: dict[str, Any]
    origins: tuple[tuple[str, str], ...] = ()  # (chat's path, the client's): what is below a path maps along with it

    def own(self, error: InvalidRequest) -> None:
        """Rewrites `error`'s param, and the message that begins with it, in the client's terms (in place: its class,
        code and status stay); the longest of `origins` that holds the param wins."""
        param = error.param
        if param is None:
            return
        for chat, own in sorted(self.origins, key=lambda o: -len(o[0])):
            if param == chat or param.startswith((f"{chat}.", f"{chat}[")):
                error.param = own + param[len(chat) :]
                if error.message.startswith(param):
                    error.message = error.param + error.message[len(param) :]
                    error.args = (error.message,)
                return


__all__ = [
    "NO_EFFECT",
    "ChatForm",
    "GenerationRequest",
    "Strict",
    "JsonSchemaSpec",
    "ResponseFormat",
    "StreamOptions",
    "StructuredOutputs",
    "unsupported",
]
