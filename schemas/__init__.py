"""Shared leaves, plain data: pydantic models at the edges (HTTP, config), the dataclasses the processes exchange and
the errors that cross them. No Ray: what needs it is in deployments/."""

from schemas.config import AppArgs, AuthArgs, EncoderArgs, ImageURLArgs, Limits, LLMArgs, VideoArgs
from schemas.engine import (
    Batch,
    ChannelOpen,
    FinishReason,
    GenerateRequest,
    Item,
    MediaItem,
    Routed,
    SamplingParams,
    TokenChunk,
    TokenLogprob,
)
from schemas.errors import ChannelLost, EncoderUnavailable, InvalidRequest, Overloaded, observe
from schemas.model_spec import ModelSpec
from schemas.resolve import resolve_device, resolve_dtype, resolve_max_model_len
from schemas.weights import Component, load_components, split_key

__all__ = [
    "AppArgs",
    "AuthArgs",
    "Batch",
    "ChannelLost",
    "ChannelOpen",
    "Component",
    "EncoderArgs",
    "EncoderUnavailable",
    "FinishReason",
    "GenerateRequest",
    "ImageURLArgs",
    "InvalidRequest",
    "Item",
    "LLMArgs",
    "MediaItem",
    "VideoArgs",
    "Limits",
    "ModelSpec",
    "Overloaded",
    "Routed",
    "SamplingParams",
    "TokenChunk",
    "TokenLogprob",
    "load_components",
    "observe",
    "resolve_device",
    "resolve_dtype",
    "resolve_max_model_len",
    "split_key",
]
