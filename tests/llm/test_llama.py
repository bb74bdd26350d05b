"""Our decoder as a Llama (LLaVA's LM): logits equal transformers' on the same weights; unsupported RoPE is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoProcessor,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaForConditionalGeneration,
    MistralConfig,
    MistralForCausalLM,
)

from demo.build_tiny import init_weights
from demo.inputs import make_image
from demo.tiny_llava import build_llava_checkpoint
from encoders import LlavaVisionEncoder
from llm import Qwen2LM, TextConfig
from llm.model import linear_positions, merge_image_embeds
from tests.llm.test_model import run_chunks


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_llava_checkpoint(tmp_path_factory.mktemp("llava") / "hub")


def test_llava_prefill_logits_match_transformers(ckpt):
    reference = LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(ckpt)
    images = [make_image(120, 80, seed=1), make_image(31, 200, seed=2)]
    text = "USER: <image>\n<image>\nCompare the two pictures. ASSISTANT:"
    inputs = processor(text=text, images=images, return_tensors="pt")
    ids = inputs["input_ids"][0]
    with torch.no_grad():
        expected = reference(**inputs).logits[0]
    model = Qwen2LM.from_pretrained(ckpt)
    assert model.config.mrope_section is None and not model.config.qkv_bias  # a Llama: 1-D RoPE, no biases
    image_token_id = reference.config.image_token_id
    positions, rope_delta = linear_positions(ids)
    with torch.no_grad():
        image_embeds = torch.cat(LlavaVisionEncoder(ckpt).encode(images))
        x = merge_image_embeds(model.embed(ids), ids == image_token_id, image_embeds)
        ours = model.logits(run_chunks(model, x, positions, [5, 20, 21]))  # chunks cut through the images
    assert rope_delta == 0
    torch.testing.assert_close(ours, expected, atol=5e-4, rtol=1e-4)  # fused ops round differently: test_model.py
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("layout", ["legacy", "prefixed"])
def test_every_layout_loads_the_same_language_model(layout, ckpt, tmp_path):
    hub = Qwen2LM.from_pretrained(ckpt).state_dict()
    other = Qwen2LM.from_pretrained(build_llava_checkpoint(tmp_path / layout, layout=layout)).state_dict()
    assert hub.keys() == other.keys()
    for name in hub:
        assert torch.equal(hub[name], other[name]), name


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_with_biases_and_its_own_head_dim_matches_transformers(tied, tmp_path):
    """Llama options LLaVA-1.5 does not use but Llama-family LMs do: biases everywhere, head_dim != hidden / heads."""
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    reference = LlamaForCausalLM(config).eval()
    init_weights(reference, seed=3, std=0.5)
    if tied:
        reference.tie_weights()
    reference.save_pretrained(tmp_path)
    model = Qwen2LM.from_pretrained(tmp_path)
    c = model.config
    assert (c.qkv_bias, c.o_bias, c.mlp_bias, c.head_dim, c.rope_theta) == (True, True, True, 16, 500.0)
    ids = torch.arange(3, 40) % 96
    with torch.no_grad():
        expected = reference(input_ids=ids[None]).logits[0]
        ours = model.logits(run_chunks(model, model.embed(ids), linear_positions(ids)[0], [7, 8]))
    torch.testing.assert_close(ours, expected, atol=5e-4, rtol=1e-4)  # fused ops round differently: test_model.py


def test_mistral_has_no_biases_and_matches_transformers(tmp_path):
    """LLaVA-NeXT's Mistral LM: no bias fields in its config (unlike Qwen2, none biased); a window is refused."""
    config = MistralConfig(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=None,
    )
    reference = MistralForCausalLM(config).eval()
    init_weights(reference, seed=4, std=0.5)
    reference.save_pretrained(tmp_path)
    model = Qwen2LM.from_pretrained(tmp_path)
    assert (model.config.qkv_bias, model.config.o_bias, model.config.mlp_bias) == (False, False, False)
    ids = torch.arange(3, 40) % 96
    with torch.no_grad():
        expected = reference(input_ids=ids[None]).logits[0]
        ours = model.logits(run_chunks(model, model.embed(ids), linear_positions(ids)[0], [7, 8]))
    torch.testing.assert_close(ours, expected, atol=5e-4, rtol=1e-4)  # fused ops round differently: test_model.py
    MistralConfig(hidden_size=32, num_attention_heads=2, sliding_window=4096).save_pretrained(tmp_path / "windowed")
    with pytest.raises(ValueError, match="sliding-window attention \\(window 4096\\)"):
        TextConfig.from_pretrained(tmp_path / "windowed")


@pytest.mark.parametrize(("rope", "name"), [
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, "linear"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192, "rope_theta": 500000.0}, "llama3"),
])  # fmt: skip
def test_scaled_rope_is_refused_with_its_name(rope, name, tmp_path):
    LlamaConfig(hidden_size=32, num_attention_heads=2, rope_parameters=rope).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"rope type '{name}' is not supported"):
        TextConfig.from_pretrained(tmp_path)
