"""App config: serve_config.yaml is valid as shipped, unknown keys are refused, every field is documented."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from schemas import AppArgs, resolve_device, resolve_dtype, resolve_max_model_len
from schemas.config import EncoderArgs, Limits, LLMArgs

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_serve_config_is_valid():
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = config["applications"][0]
    assert app["import_path"] == "deployments.app:build_app"
    assert app["args"]["model"] == "demo/qwen2-vl-shapes"  # the trained demo model, committed
    args = AppArgs.model_validate({**app["args"], "model": str(ROOT / app["args"]["model"])})
    assert args.device == "auto" and args.limits.max_images_per_request == 8
    names = {d["name"] for d in app["deployments"]}
    assert not args.encoder.colocated and names == {"Ingress", "Encoder", "LLM"}  # what build_app binds: the tier


def test_unknown_keys_and_bad_model_are_refused(checkpoint, tmp_path):
    with pytest.raises(ValidationError, match="max_imagez"):
        AppArgs.model_validate({"model": str(checkpoint), "limits": {"max_imagez": 3}})
    with pytest.raises(ValidationError, match="not a checkpoint directory"):
        AppArgs.model_validate({"model": str(tmp_path)})


@pytest.mark.parametrize("model", [AppArgs, Limits, LLMArgs, EncoderArgs])
def test_every_field_has_a_description(model: type[BaseModel]):
    assert all(f.description for f in model.model_fields.values()), model


def test_device_dtype_and_context_resolution():
    assert resolve_device("auto", has_gpu=False) == "cpu" and resolve_device("auto", has_gpu=True) == "cuda"
    assert resolve_dtype("auto", "cpu") == "float32" and resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_max_model_len(None, 4096) == 4096 and resolve_max_model_len(None, 131072) == 32768
    with pytest.raises(ValueError, match="exceeds the checkpoint's 4096"):
        resolve_max_model_len(8192, 4096)


def test_tensor_parallel_size_at_the_top_or_under_llm(checkpoint):
    model = str(checkpoint)
    assert AppArgs.model_validate({"model": model, "tensor_parallel_size": 2}).llm.tensor_parallel_size == 2
    assert AppArgs.model_validate({"model": model, "llm": {"tensor_parallel_size": 2}}).tensor_parallel_size == 2
    dumped = AppArgs.model_validate({"model": model, "tensor_parallel_size": 4}).model_dump()
    assert AppArgs.model_validate(dumped).llm.tensor_parallel_size == 4  # what the replicas re-validate
    with pytest.raises(ValidationError, match="tensor_parallel_size=2 and llm.tensor_parallel_size=4 disagree"):
        AppArgs.model_validate({"model": model, "tensor_parallel_size": 2, "llm": {"tensor_parallel_size": 4}})
