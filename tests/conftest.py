"""Shared fixtures: tiny random Qwen2-VL checkpoints (both layouts), the transformers reference, test images."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from demo.build_tiny import build_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """Hub layout (`visual.*`, `model.*`, `lm_head.*`): what real checkpoints and transformers 5 use."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2-vl-tiny", seed=0, max_pixels=28 * 28 * 64)


@pytest.fixture(scope="session")
def legacy_checkpoint(tmp_path_factory) -> Path:
    """transformers 4.52-4.57 layout (`model.visual.*`, `model.language_model.*`), same weights."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2-vl-tiny-legacy", seed=0,
                            max_pixels=28 * 28 * 64, layout="legacy")


@pytest.fixture(scope="session")
def reference(checkpoint):
    """transformers' own model on the same weights: the answer we must match."""
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
