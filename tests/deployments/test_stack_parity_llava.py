"""LLaVA-1.5 through the deployed app over HTTP: greedy output equals transformers' generate on the same checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import LlavaForConditionalGeneration

from demo.tiny_llava import build_llava_checkpoint
from tests.deployments.parity import CASES, assert_greedy_equals_reference, deployed, processor_generate

pytestmark = pytest.mark.e2e  # MAX_TOKENS: the tiny checkpoint's greedy margins are above 0.02 for that many steps


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_llava_checkpoint(tmp_path_factory.mktemp("llava") / "llava-tiny")


@pytest.fixture(scope="module")
def reference(ckpt):
    return LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def client(ray_serve, app_args, ckpt):
    with deployed(ray_serve, app_args, ckpt, "llava") as client:
        yield client


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_transformers(case, client, ckpt, reference):
    assert_greedy_equals_reference(client, ckpt, reference, CASES[case], generate=processor_generate)


def test_full_feature_strategy_keeps_the_cls_token(ray_serve, app_args, tmp_path_factory):
    """With vision_feature_select_strategy "full", an image takes h*w + 1 tokens, still equal to transformers."""
    ckpt = build_llava_checkpoint(tmp_path_factory.mktemp("llava-full") / "llava-full", select_strategy="full")
    reference = LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    with deployed(ray_serve, app_args, ckpt, "llava-full") as client:
        for case in ("one_image", "three_images"):
            assert_greedy_equals_reference(client, ckpt, reference, CASES[case], generate=processor_generate)
