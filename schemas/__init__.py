"""Pydantic models at the edges (HTTP, config) and the small dataclasses components exchange."""

from schemas.checkpoint import Component, load_components, split_key
from schemas.config import AppArgs, AuthArgs, EncoderArgs, ImageURLArgs, LLMArgs, Limits, resolve_device, resolve_dtype, resolve_max_model_len
from schemas.engine import FinishReason, GenerateRequest, SamplingParams, TokenChunk, TokenLogprob
from schemas.errors import EncoderUnavailable, InvalidRequest, Overloaded

__all__ = [
    "AppArgs",
    "AuthArgs",
    "Component",
    "EncoderArgs",
    "EncoderUnavailable",
    "FinishReason",
    "ImageURLArgs",
    "GenerateRequest",
    "InvalidRequest",
    "LLMArgs",
    "Limits",
    "Overloaded",
    "SamplingParams",
    "TokenChunk",
    "TokenLogprob",
    "load_components",
    "resolve_device",
    "resolve_dtype",
    "resolve_max_model_len",
    "split_key",
]
