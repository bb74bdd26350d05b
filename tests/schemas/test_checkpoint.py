"""Checkpoint layouts, and that each component reads only its own tensors from disk."""

from __future__ import annotations

import pytest

import schemas.checkpoint as ckpt
from encoders import Qwen2VLVisionEncoder
from llm import Qwen2LM
from schemas import split_key


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("visual.blocks.0.attn.qkv.weight", ("vision", "blocks.0.attn.qkv.weight")),
        ("model.visual.merger.mlp.0.bias", ("vision", "merger.mlp.0.bias")),
        ("model.layers.3.mlp.up_proj.weight", ("text", "layers.3.mlp.up_proj.weight")),
        ("model.language_model.embed_tokens.weight", ("text", "embed_tokens.weight")),
        ("lm_head.weight", ("lm_head", "weight")),
        ("something.else", None),
    ],
)
def test_split_key_both_layouts(key, expected):
    assert split_key(key) == expected


@pytest.fixture
def tensors_read(monkeypatch):
    """Records every tensor name a loader reads from safetensors files."""
    seen: list[str] = []
    real = ckpt.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            seen.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(ckpt, "safe_open", Spy)
    return seen


@pytest.mark.parametrize("layout", ["checkpoint", "legacy_checkpoint"])
def test_encoder_reads_only_vision_and_llm_reads_no_vision(layout, request, tensors_read):
    path = request.getfixturevalue(layout)
    Qwen2VLVisionEncoder(path)
    assert tensors_read and all(split_key(k)[0] == "vision" for k in tensors_read)
    tensors_read.clear()
    Qwen2LM.from_pretrained(path)
    assert tensors_read and all(split_key(k)[0] in ("text", "lm_head") for k in tensors_read)
    assert any(k.startswith("lm_head.") for k in tensors_read)
