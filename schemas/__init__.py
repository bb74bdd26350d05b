"""Shared leaves: pydantic models at the edges (HTTP, config), the dataclasses the processes exchange, the errors that
cross them, and the safetensors weight reader. (`schemas.metrics`, `schemas.transfer`: import them by name.)"""

from schemas.config import AppArgs, AuthArgs, EncoderArgs, ImageURLArgs, Limits, LLMArgs, VideoArgs
from schemas.engine import (
    DRAIN_POLL_S,
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
    this_replica,
)
from schemas.errors import (
    LLM_GONE,
    REPLICA_GONE,
    ChannelLost,
    EncoderUnavailable,
    InvalidRequest,
    Overloaded,
    observe,
    quiet_client_errors,
    root_cause,
)
from schemas.model_spec import ModelSpec
from schemas.resolve import resolve_device, resolve_dtype, resolve_max_model_len
from schemas.weights import Component, load_components, split_key

__all__ = [
    "LLM_GONE",
    "REPLICA_GONE",
    "AppArgs",
    "AuthArgs",
    "Batch",
    "ChannelLost",
    "ChannelOpen",
    "Component",
    "DRAIN_POLL_S",
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
    "quiet_client_errors",
    "resolve_device",
    "resolve_dtype",
    "resolve_max_model_len",
    "root_cause",
    "split_key",
    "this_replica",
]
