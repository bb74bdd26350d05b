"""The family comes from the checkpoint's model_type, or from args.family; anything else fails at build time with
the list of supported families."""

from __future__ import annotations

import json
import shutil

import pytest

from deployments.app import build_app
from encoders import FAMILIES, family_of


def test_model_type_picks_the_family(checkpoint):
    assert family_of(checkpoint) is FAMILIES["qwen2_vl"]


def test_an_unsupported_checkpoint_fails_at_build_listing_the_families(checkpoint, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "paligemma"}))
    with pytest.raises(
        ValueError,
        match=r"model_type 'paligemma' is not supported; supported: \['llava', 'llava_next', "
        r"'qwen2_5_vl', 'qwen2_vl', 'qwen3_vl'\]",
    ):
        build_app({"model": str(other)})
    # ...unless args.family says which family it is.
    assert family_of(other, "qwen2_vl") is FAMILIES["qwen2_vl"]
    build_app({"model": str(other), "family": "qwen2_vl"})
    with pytest.raises(ValueError, match="family 'gemma3' is not supported"):
        build_app({"model": str(other), "family": "gemma3"})


def test_qwen3_vl_moe_fails_at_build_saying_what_is_missing(checkpoint, tmp_path):
    """Qwen3-VL's MoE checkpoints (30B-A3B, 235B-A22B) need mixture-of-experts layers: the error says so."""
    moe = tmp_path / "moe"
    shutil.copytree(checkpoint, moe)
    config = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_vl_moe"}))
    with pytest.raises(ValueError, match="'qwen3_vl_moe' is not supported: .*mixture-of-experts layers"):
        build_app({"model": str(moe)})
