"""Prefill overlapped with encoding, served: with the ViT slowed, a request's first prefill chunk runs on the LLM
replica before its images are encoded, and its greedy tokens still equal transformers'. For Qwen2-VL (M-RoPE: an
image's grid gives its tokens) and the LLaVAs (1-D RoPE: the ingress's token count, num_image_tokens, gives them)."""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from ray import serve
from transformers import LlavaForConditionalGeneration, LlavaNextForConditionalGeneration

from demo.tiny_llava import build_llava_checkpoint
from demo.tiny_llava_next import build_llava_next_checkpoint
from deployments.encoder.server import Encoder
from deployments.ingress import Ingress
from deployments.llm.server import LLM
from tests.deployments.instruments import RecordingLM, SlowEncoder, forwards, llm_forwards
from tests.deployments.parity import CASES, MAX_TOKENS, openai_messages, processor_generate, reference_generate

pytestmark = pytest.mark.e2e
SMALL = {"num_cpus": 0.1}
ENCODE_S = 2.0  # each encoder forward: far longer than the ingress takes to start the generation
CAP_S = 120.0  # how long a wait on state may take before the test fails: generous, never the assertion itself
# The family's tiny checkpoint builder (None: the session's Qwen2-VL), transformers' model and its pipeline
FAMILIES = {
    "qwen2_vl": (None, None, reference_generate),
    "llava": (build_llava_checkpoint, LlavaForConditionalGeneration, processor_generate),
    "llava_next": (build_llava_next_checkpoint, LlavaNextForConditionalGeneration, processor_generate),
}


@pytest.fixture(scope="module", params=[*FAMILIES, "qwen2_vl-off"])
def overlap(request, ray_serve, app_args, tmp_path_factory):
    """One family's app with a slowed encoder and a recording LM at /overlap-<family>; -> (url, record dir,
    checkpoint, transformers' model, transformers' pipeline, whether overlap is on). `-off`: llm.overlap_encoding
    false."""
    family, _, off = request.param.partition("-")
    build, reference_class, generate = FAMILIES[family]
    if build is None:
        checkpoint, reference = request.getfixturevalue("checkpoint"), request.getfixturevalue("reference")
    else:
        checkpoint = build(tmp_path_factory.mktemp(request.param) / "tiny")
        reference = reference_class.from_pretrained(checkpoint, dtype=torch.float32).eval()
    record_dir, name = str(tmp_path_factory.mktemp("overlap")), f"overlap-{request.param}"
    args = {
        **app_args,
        "model": str(checkpoint),
        "encoder": {"cache_gib": 0, "max_batch_wait_ms": 0, "startup_check": False},
        "llm": {**app_args.get("llm", {}), "overlap_encoding": not off},
    }
    encoder = Encoder.options(ray_actor_options=SMALL, autoscaling_config=None, num_replicas=1).bind(
        args, model_factory=functools.partial(SlowEncoder, delay_s=ENCODE_S, record_dir=record_dir)
    )
    llm = LLM.options(ray_actor_options=SMALL).bind(args, model_factory=RecordingLM.recording(record_dir))
    ingress = Ingress.options(ray_actor_options=SMALL).bind(encoder, llm, args)
    serve.run(ingress, name=name, route_prefix=f"/{name}")
    yield f"{ray_serve}/{name}", record_dir, checkpoint, reference, generate, not off
    serve.delete(name)


def _wait_for(condition, timeout_s: float = CAP_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_first_prefill_runs_before_the_images_are_encoded(overlap):
    url, record_dir, checkpoint, reference, generate, on = overlap
    conversation = CASES["three_images"]  # text before the first image: the first chunk runs without any
    body = {"messages": openai_messages(conversation), "max_tokens": MAX_TOKENS, "temperature": 0}
    lm_before, encoded_before = len(llm_forwards(record_dir)), len(forwards(record_dir))
    with ThreadPoolExecutor(1) as pool:
        response = pool.submit(
            httpx.post, f"{url}/v1/chat/completions", json={**body, "return_token_ids": True}, timeout=CAP_S
        )
        _wait_for(lambda: len(llm_forwards(record_dir)) > lm_before or response.done())
        r = response.result()
    assert r.status_code == 200, r.text
    first_prefill_at, tokens = llm_forwards(record_dir)[lm_before]
    first_encoded_at = forwards(record_dir)[encoded_before][1]  # the end of the first encoder forward
    if on:
        assert first_prefill_at < first_encoded_at, (first_prefill_at, first_encoded_at, tokens)
    else:  # llm.overlap_encoding false: the request enters the engine once every image is encoded
        assert first_prefill_at > forwards(record_dir)[-1][1], (first_prefill_at, forwards(record_dir)[-1])
    assert r.json()["choices"][0]["token_ids"] == generate(checkpoint, reference, conversation)[1]
