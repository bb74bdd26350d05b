"""Facts load once: each process reads the checkpoint's transformers config a single time (encoders/model_spec.py),
and the spec holds what the ingress and the LLM must agree on."""

from __future__ import annotations

import pytest
import ray
from transformers import AutoConfig

from deployments.encoder.server import Encoder
from deployments.ingress import Ingress
from deployments.llm.server import LLM
from encoders import ModelSpec, Qwen2VLVisionEncoder
from encoders.checkpoint_config import plain_config, read_config


@pytest.fixture
def config_loads(monkeypatch):
    """How many times the transformers config (config.json) is read."""
    counts = {"config": 0}
    config_load = AutoConfig.from_pretrained

    def config(*args, **kwargs):
        counts["config"] += 1
        return config_load(*args, **kwargs)

    monkeypatch.setattr(AutoConfig, "from_pretrained", config)
    return counts


def test_the_spec_holds_the_checkpoints_facts(checkpoint, reference):
    spec = ModelSpec.load(checkpoint, max_model_len=256, device="cpu", dtype="auto")
    cfg = reference.config
    assert spec.image_tokens.placeholder_id == cfg.image_token_id
    assert spec.image_tokens.per_image_ids == (cfg.vision_start_token_id, cfg.vision_end_token_id)
    assert spec.merge_size == cfg.vision_config.spatial_merge_size
    assert spec.max_model_len == 256 and spec.device == "cpu" and str(spec.dtype) == "torch.float32"
    assert spec.text_config.hidden_size == cfg.text_config.hidden_size
    with pytest.raises(ValueError, match="exceeds the checkpoint's"):
        ModelSpec.load(checkpoint, max_model_len=1 << 30)


@pytest.fixture
def no_ray_left(monkeypatch):
    """The replicas' classes built here, outside Serve, may start a local Ray (their metrics): stop it again, so
    that the served tests of this session start theirs. A new one of its own: by default Ray's auto-init joins the
    cluster named in /tmp/ray/ray_current_cluster, another session's, or a dead one whose GCS it waits for."""
    monkeypatch.setenv("RAY_ADDRESS", "local")
    was_up = ray.is_initialized()
    yield
    if not was_up and ray.is_initialized():
        ray.shutdown()


@pytest.mark.parametrize("replica", ["ingress", "encoder", "llm", "llm colocated"])
def test_each_replica_reads_the_config_once(checkpoint, config_loads, no_ray_left, replica):
    args = {"model": str(checkpoint), "encoder": {"startup_check": False, "colocated": replica == "llm colocated"}}
    if replica == "ingress":
        Ingress.func_or_class(None, None, args)
    elif replica == "encoder":
        Encoder.func_or_class(args, None)
    else:
        LLM.func_or_class(args).engine.close()
    assert config_loads["config"] == 1, f"the {replica} replica read config.json {config_loads['config']} times"


class _Factory(Qwen2VLVisionEncoder):
    """A model factory, as the benchmarks' and tests' stand-ins for the family's encoder are."""


@pytest.mark.parametrize("factory", [None, _Factory])
def test_an_encoder_replica_given_the_app_builders_config_reads_none(checkpoint, config_loads, no_ray_left, factory):
    """As deployed (deployments/app.py), an Encoder replica gets the config as data: it reads no config.json through
    transformers (whose import is ~1/3 of a new replica's start: tests/test_replica_imports.py), nor does a model
    factory standing in for the family's encoder."""
    args = {"model": str(checkpoint), "encoder": {"startup_check": False}}
    config = plain_config(read_config(checkpoint))
    config_loads["config"] = 0
    encoder = Encoder.func_or_class(args, factory, config=config)
    assert config_loads["config"] == 0
    assert encoder.runner.encoder.hidden_size == read_config(checkpoint).text_config.hidden_size
