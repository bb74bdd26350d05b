"""A long video across the encoder tier: with two Encoder replicas, the chunks of one request's video are encoded by
both (the ingress sends one call per chunk, concurrently, and the cost router spreads them), and the answer is the one
the session's app gives, which encodes the whole video in one call on one replica."""

from __future__ import annotations

import httpx
import pytest
from ray import serve

from demo.inputs import make_video, video_url
from deployments.encoder.server import Encoder
from deployments.ingress import Ingress
from deployments.llm.server import LLM

pytestmark = pytest.mark.e2e
SMALL = {"num_cpus": 0.1}  # this app shares the session's logical CPUs with the others
KW = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16}  # 160x120 frames: 112x84, 48 patches a tubelet
VIDEO = make_video(4, fps=8, width=160, height=120, seed=21)  # 32 frames: 8 sampled, 4 tubelets
NUM_CHUNKS = 4  # at 48 patches a batch, one tubelet a chunk


@pytest.fixture(scope="module")
def fanned(ray_serve, app_args):
    """The session's app settings, with two Encoder replicas, a batch of one tubelet and no embedding cache (each
    chunk is encoded, none found)."""
    args = {**app_args, "encoder": {"max_batch_patches": 48, "cache_gib": 0, "startup_check": False}}
    encoder = Encoder.options(ray_actor_options=SMALL, num_replicas=2, autoscaling_config=None).bind(args)
    llm = LLM.options(ray_actor_options=SMALL).bind(args)
    serve.run(Ingress.options(ray_actor_options=SMALL).bind(encoder, llm, args), name="fanout", route_prefix="/fanout")
    with httpx.Client(base_url=f"{ray_serve}/fanout", timeout=120) as client:
        yield client
    serve.delete("fanout")


def _encoded_per_replica() -> list[int]:
    """Images (here: video chunks) each Encoder replica of the app has run through its ViT, smallest first."""
    stats = serve.get_deployment_handle("Encoder", app_name="fanout").broadcast("stats").results(timeout_s=60)
    return sorted(int(s["images"]) for s in stats)


def _answer(client: httpx.Client) -> dict:
    part = {"type": "video_url", "video_url": {"url": video_url(VIDEO)}}
    body = {
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What happens?"}]}],
        "max_tokens": 16,
        "temperature": 0,
        "return_token_ids": True,
        "mm_processor_kwargs": KW,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_videos_chunks_reach_both_encoder_replicas_and_the_answer_is_one_replicas(fanned, client):
    assert _encoded_per_replica() == [0, 0]  # two replicas, fresh
    fanned_out = _answer(fanned)
    per_replica = _encoded_per_replica()
    assert sum(per_replica) == NUM_CHUNKS and per_replica[0] > 0, per_replica  # both encoded chunks of this request
    whole = _answer(client)  # the session's app: 16384 patches a batch, the video in one call
    assert fanned_out["prompt_token_ids"] == whole["prompt_token_ids"]
    assert fanned_out["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"]
