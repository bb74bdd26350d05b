"""Shared leaves, plain data: pydantic models at the edges (HTTP, config), the dataclasses the processes exchange and
the errors that cross them. Importing it loads no torch, transformers or Ray: the checkpoint's facts are
`encoders.ModelSpec`, its weights' reader `encoders.weights`, and what needs Ray is in `deployments`."""

from schemas.config import AppArgs, AuthArgs, EncoderArgs, ImageURLArgs, Limits, LLMArgs, VideoArgs
from schemas.engine import FinishReason, GenerateRequest, MediaItem, SamplingParams, TokenChunk, TokenLogprob
from schemas.errors import ChannelLost, EncoderUnavailable, InvalidRequest, Overloaded, observe
from schemas.resolve import resolve_device, resolve_dtype, resolve_max_model_len

__all__ = [
    "AppArgs",
    "AuthArgs",
    "ChannelLost",
    "EncoderArgs",
    "EncoderUnavailable",
    "FinishReason",
    "GenerateRequest",
    "ImageURLArgs",
    "InvalidRequest",
    "LLMArgs",
    "MediaItem",
    "VideoArgs",
    "Limits",
    "Overloaded",
    "SamplingParams",
    "TokenChunk",
    "TokenLogprob",
    "observe",
    "resolve_device",
    "resolve_dtype",
    "resolve_max_model_len",
]
