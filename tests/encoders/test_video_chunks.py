"""A video encoded in chunks of tubelets (as the ingress spreads it over encoder replicas) equals the whole video
encoded at once, for Qwen2-VL's ViT and Qwen2.5-VL's (window attention): the ViTs attend within a tubelet only."""

from __future__ import annotations

import pytest
import torch

from demo.inputs import image_bytes, make_image
from demo.tiny_qwen2_5_vl import build_qwen2_5_vl_checkpoint
from encoders import Qwen2_5_VLVisionEncoder, Qwen2VLVisionEncoder
from encoders.video_decode import decode_frames
from encoders.video_processing import Qwen2VLVideoProcessing, SamplingRequest, VideoMeta

PROC = Qwen2VLVideoProcessing(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 12)


def test_chunk_plans_cover_the_video_in_order():
    plan = PROC.frame_list_plan(VideoMeta(10, 2.0, 150, 100), SamplingRequest(), 10**9)
    t, h, w = plan.grid_thw
    assert (t, len(plan.indices)) == (5, 10)
    ranges = plan.chunks(2 * h * w)
    assert ranges == [(0, 2), (2, 4), (4, 5)] and plan.chunks(10**9) == [(0, 5)] and plan.chunks(1)[1] == (1, 2)
    parts = [plan.chunk(a, b) for a, b in ranges]
    assert sum((p.indices for p in parts), ()) == plan.indices
    assert [p.grid_thw for p in parts] == [(2, h, w), (2, h, w), (1, h, w)]
    assert sum(p.num_tokens for p in parts) == plan.num_tokens


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def encoder(request, tmp_path_factory):
    if request.param == "qwen2_vl":
        return Qwen2VLVisionEncoder(request.getfixturevalue("checkpoint"))
    return Qwen2_5_VLVisionEncoder(build_qwen2_5_vl_checkpoint(tmp_path_factory.mktemp("q25") / "q25", seed=1))


def test_chunks_encoded_apart_equal_the_whole_video(encoder):
    frames = [image_bytes(make_image(150, 100, seed=s)) for s in range(10)]
    plan = PROC.frame_list_plan(VideoMeta(10, 2.0, 150, 100), SamplingRequest(), 10**9)
    whole = encoder.forward([PROC.preprocess(decode_frames(frames, plan))])[0]  # (tokens, llm_hidden)
    t, h, w = plan.grid_thw
    parts = [PROC.preprocess(decode_frames(frames, plan.chunk(a, b))) for a, b in plan.chunks(2 * h * w)]
    chunked = torch.cat([encoder.forward([part])[0] for part in parts])
    assert chunked.shape == whole.shape == (plan.num_tokens, encoder.hidden_size)
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-5)
    # Packed with an image in one forward, as the batcher does: the same rows.
    image = PROC.preprocess(decode_frames(frames[:1] * 2, PROC.frame_list_plan(VideoMeta(2, 2.0, 150, 100),
                                                                                SamplingRequest(), 10**9)))  # fmt: skip
    packed = torch.cat(encoder.forward([image, *parts])[1:])
    torch.testing.assert_close(packed, whole, rtol=1e-4, atol=1e-5)
