"""What "auto" and "unset" mean for the device, the dtype and the context length, resolved in each process."""

from __future__ import annotations

from typing import Literal

from schemas.config import Device, DType


def resolve_device(device: Device, has_gpu: bool) -> Literal["cpu", "cuda"]:
    return ("cuda" if has_gpu else "cpu") if device == "auto" else device


def resolve_dtype(dtype: DType, device: str) -> Literal["float32", "bfloat16", "float16"]:
    return ("bfloat16" if device == "cuda" else "float32") if dtype == "auto" else dtype


def resolve_max_model_len(configured: int | None, max_position_embeddings: int) -> int:
    """The context length both the ingress (admission) and the LLM (cache size) use."""
    if configured is not None and configured > max_position_embeddings:
        raise ValueError(f"max_model_len={configured} exceeds the checkpoint's {max_position_embeddings} positions")
    return configured if configured is not None else min(max_position_embeddings, 32768)


__all__ = ["resolve_device", "resolve_dtype", "resolve_max_model_len"]
