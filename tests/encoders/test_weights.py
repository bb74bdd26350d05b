"""Checkpoint layouts, and that each component reads only its own tensors from disk."""

from __future__ import annotations

import pytest

import encoders.weights as ckpt
from demo.tiny_llava import build_llava_checkpoint
from demo.tiny_llava_next import build_llava_next_checkpoint
from encoders import LlavaNextVisionEncoder, LlavaVisionEncoder, Qwen2VLVisionEncoder
from encoders.weights import split_key
from llm import Qwen2LM


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("visual.blocks.0.attn.qkv.weight", ("vision", "blocks.0.attn.qkv.weight")),
        ("model.visual.merger.mlp.0.bias", ("vision", "merger.mlp.0.bias")),
        ("model.layers.3.mlp.up_proj.weight", ("text", "layers.3.mlp.up_proj.weight")),
        ("model.language_model.embed_tokens.weight", ("text", "embed_tokens.weight")),
        ("lm_head.weight", ("lm_head", "weight")),
        ("something.else", None),
        # LLaVA: llava-hf (4.x), transformers 5, and transformers 4.52-4.57 names of the same tensors.
        ("vision_tower.vision_model.post_layernorm.bias", ("vision", "vision_tower.post_layernorm.bias")),
        ("vision_tower.encoder.layers.0.mlp.fc1.weight", ("vision", "vision_tower.encoder.layers.0.mlp.fc1.weight")),
        ("model.vision_tower.vision_model.pre_layrnorm.bias", ("vision", "vision_tower.pre_layrnorm.bias")),
        ("model.vision_tower.embeddings.class_embedding", ("vision", "vision_tower.embeddings.class_embedding")),
        ("multi_modal_projector.linear_1.weight", ("vision", "multi_modal_projector.linear_1.weight")),
        ("model.multi_modal_projector.linear_2.bias", ("vision", "multi_modal_projector.linear_2.bias")),
        ("language_model.model.layers.1.self_attn.q_proj.weight", ("text", "layers.1.self_attn.q_proj.weight")),
        ("language_model.lm_head.weight", ("lm_head", "weight")),
        # LLaVA-NeXT's row separator: llava-hf and transformers 5, then transformers 4.52-4.57.
        ("image_newline", ("vision", "image_newline")),
        ("model.image_newline", ("vision", "image_newline")),
    ],
)
def test_split_key_every_layout(key, expected):
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


@pytest.mark.parametrize("layout", ["hub", "legacy", "prefixed"])
def test_llava_encoder_reads_only_vision_and_llm_reads_no_vision(layout, tmp_path, tensors_read):
    path = build_llava_checkpoint(tmp_path / layout, layout=layout)
    LlavaVisionEncoder(path)
    assert tensors_read and all(split_key(k)[0] == "vision" for k in tensors_read)
    assert any("multi_modal_projector." in k for k in tensors_read)
    tensors_read.clear()
    Qwen2LM.from_pretrained(path)
    assert tensors_read and all(split_key(k)[0] in ("text", "lm_head") for k in tensors_read)
    assert any("lm_head." in k for k in tensors_read)


def test_llava_next_image_newline_goes_to_the_encoder_only(tmp_path, tensors_read):
    """transformers 4.52-4.57's `model.image_newline` is read by the encoder, never by the LLM (whose loader is
    strict: it would refuse a stray tensor)."""
    path = build_llava_next_checkpoint(tmp_path / "prefixed", layout="prefixed")
    LlavaNextVisionEncoder(path)
    assert "model.image_newline" in tensors_read and all(split_key(k)[0] == "vision" for k in tensors_read)
    tensors_read.clear()
    Qwen2LM.from_pretrained(path)
    assert tensors_read and all(split_key(k)[0] in ("text", "lm_head") for k in tensors_read)
