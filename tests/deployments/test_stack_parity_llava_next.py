"""LLaVA-NeXT through the deployed app over HTTP: greedy output equals transformers' generate on the same checkpoint,
with images of different sizes (so different tile counts, unpadding and token counts)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlavaNextForConditionalGeneration

from demo.tiny_llava_next import build_llava_next_checkpoint
from tests.deployments.parity import CASES, assert_greedy_equals_reference, deployed, processor_generate

pytestmark = pytest.mark.e2e  # MAX_TOKENS: the tiny checkpoint's greedy margins are above 0.05 for that many steps


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_llava_next_checkpoint(tmp_path_factory.mktemp("llava_next") / "llava-next-tiny")


@pytest.fixture(scope="module")
def reference(ckpt):
    return LlavaNextForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def client(ray_serve, app_args, ckpt):
    with deployed(ray_serve, app_args, ckpt, "llava-next") as client:
        yield client


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_transformers(case, client, ckpt, reference):
    assert_greedy_equals_reference(client, ckpt, reference, CASES[case], generate=processor_generate)
