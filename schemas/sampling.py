"""The request's sampling fields: OpenAI's, and vLLM's extensions to them, with their wire defaults. A field left out
(or null) where the checkpoint's generation_config.json has a value takes that value (ModelSpec.sampling_defaults)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator

from schemas.messages import _Tolerant

Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class SamplingFields(_Tolerant):
    # None: the checkpoint's generation_config.json value where it has one, else temperature 1, top_p 1, top_k off,
    # min_p off, repetition_penalty 1 (vLLM's `--generation-config auto`).
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: list[str] = Field(default_factory=list, description="Up to max_stop strings; a string means one.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, Bias] = Field(default_factory=dict, description="token id (as a string) -> -100..100")
    # Extensions, as in vLLM: top_k (0 or -1: off), min_p, repetition_penalty (over the prompt and the output),
    # min_tokens; stop_token_ids; keep generating past EOS (benchmarks that need exact output lengths); the stop
    # string (or stop token's text) kept at the end of the text; special tokens in the text.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

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


__all__ = ["SamplingFields"]
