"""Fixtures of the llm tests: our decoder and vision encoder on the session's tiny checkpoint."""

from __future__ import annotations

import pytest

from encoders import Qwen2VLVisionEncoder
from llm import Qwen2LM


@pytest.fixture(scope="session")
def model(checkpoint):
    return Qwen2LM.from_pretrained(checkpoint)


@pytest.fixture(scope="session")
def vision(checkpoint):
    return Qwen2VLVisionEncoder(checkpoint)
