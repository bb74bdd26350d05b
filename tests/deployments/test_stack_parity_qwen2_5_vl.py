"""Qwen2.5-VL through the deployed app over HTTP: greedy output equals transformers' generate on the same checkpoint."""

from __future__ import annotations

import httpx
import pytest
import torch
from ray import serve
from transformers import Qwen2_5_VLForConditionalGeneration

from demo.tiny_qwen2_5_vl import build_qwen2_5_vl_checkpoint
from deployments import build_app
from tests.deployments.parity import CASES, assert_greedy_equals_reference

pytestmark = pytest.mark.e2e
APP = "qwen25"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # NOTE: seed 1: every top-1/top-2 logit gap over these cases' 24 greedy steps is > 0.025 (seed 0: 0.012).
    return build_qwen2_5_vl_checkpoint(tmp_path_factory.mktemp("q25") / "qwen2.5-vl-tiny", seed=1)


@pytest.fixture(scope="module")
def ref(ckpt):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def qwen25_client(ray_serve, app_args, ckpt):
    """Its own application next to (never instead of) the Qwen2-VL one that other modules use."""
    serve.run(build_app({**app_args, "model": str(ckpt)}), name=APP, route_prefix=f"/{APP}")
    try:
        with httpx.Client(base_url=f"{ray_serve}/{APP}", timeout=60) as c:
            yield c
    finally:
        serve.delete(APP)


def test_the_app_serves_the_qwen2_5_vl_checkpoint(qwen25_client):
    assert [m["id"] for m in qwen25_client.get("/v1/models").json()["data"]] == ["qwen2.5-vl-tiny"]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_transformers(case, qwen25_client, ckpt, ref):
    assert_greedy_equals_reference(qwen25_client, ckpt, ref, CASES[case])
