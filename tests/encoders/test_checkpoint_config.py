"""An Encoder replica takes the checkpoint's config as the data the app builder resolved
(encoders/checkpoint_config.py), not from transformers: what it builds from that data must be what the config read
through transformers builds, for each family (defaults, sub-configs and `attribute_map` aliases included)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from PIL import Image
from transformers import GenerationConfig

from demo.tiny_llava import build_llava_checkpoint
from demo.tiny_llava_next import build_llava_next_checkpoint
from demo.tiny_qwen2_5_vl import build_qwen2_5_vl_checkpoint
from encoders import ModelSpec
from encoders.checkpoint_config import ConfigView, plain_config, read_config, read_generation_config
from encoders.model_spec import SAMPLING_KEYS

BUILDERS = {
    "qwen2_vl": None,  # the session's `checkpoint`
    "qwen2_5_vl": lambda out: build_qwen2_5_vl_checkpoint(out, seed=1),
    "llava": build_llava_checkpoint,
    "llava_next": build_llava_next_checkpoint,
}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family_checkpoint(request, checkpoint, tmp_path_factory):
    build = BUILDERS[request.param]
    return checkpoint if build is None else build(tmp_path_factory.mktemp("ckpt") / request.param)


def _as_sent(model_dir) -> ConfigView:
    """The config as an Encoder replica receives it: plain data, through JSON (what Ray's pickle of it keeps)."""
    return ConfigView(json.loads(json.dumps(plain_config(read_config(model_dir)))))


def _facts(spec: ModelSpec) -> dict:
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "hf_config"}


def test_the_spec_from_the_sent_config_is_the_spec_read_through_transformers(family_checkpoint):
    read = ModelSpec.load(family_checkpoint, device="cpu", dtype="float32")
    sent = ModelSpec.load(family_checkpoint, device="cpu", dtype="float32", config=_as_sent(family_checkpoint))
    assert _facts(sent) == _facts(read)
    assert sent.text_config.hidden_size == read.text_config.hidden_size


def test_the_encoder_built_from_the_sent_config_encodes_as_the_read_one(family_checkpoint):
    images = [Image.new("RGB", (64, 48), (200, 30, 90)), Image.effect_noise((40, 72), 60).convert("RGB")]
    out = []
    for config in (read_config(family_checkpoint), _as_sent(family_checkpoint)):
        spec = ModelSpec.load(family_checkpoint, device="cpu", dtype="float32", config=config)
        out.append(
            spec.family.encoder(family_checkpoint, device="cpu", dtype=torch.float32, config=config).encode(images)
        )
    assert [e.shape for e in out[0]] == [e.shape for e in out[1]]
    assert all(torch.equal(a, b) for a, b in zip(*out, strict=True))


def test_aliases_and_sub_configs_read_as_transformers_reads_them(checkpoint, tmp_path):
    """LLaVA's `image_token_id` is an alias of `image_token_index`; Qwen's vision `num_hidden_layers`, of `depth`."""
    qwen = read_config(checkpoint).vision_config
    assert _as_sent(checkpoint).vision_config.num_hidden_layers == qwen.num_hidden_layers == qwen.depth
    ckpt = build_llava_checkpoint(tmp_path / "llava")
    config, view = read_config(ckpt), _as_sent(ckpt)
    assert view.image_token_id == config.image_token_id == config.image_token_index
    assert view.vision_config.hidden_act == config.vision_config.hidden_act  # a default: not in config.json
    assert isinstance(view.text_config, ConfigView) and isinstance(view.id2label, dict)


def test_the_generation_config_reads_as_transformers_reads_it(checkpoint, tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"eos_token_id": [3, 7], "temperature": 0.7, "top_k": 20, "do_sample": True}))
    ours, theirs = read_generation_config(tmp_path), GenerationConfig.from_pretrained(tmp_path)
    for key in (*SAMPLING_KEYS, "eos_token_id"):
        assert ours.get(key) == getattr(theirs, key), key
    assert read_generation_config(tmp_path / "none") is None
