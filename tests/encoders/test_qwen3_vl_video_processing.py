"""Qwen3-VL's video sampling against transformers' own Qwen3VLVideoProcessor (its frame sampling, its patch count,
with and without the per-frame cap) and Qwen3VLProcessor's timestamps: the parts of them that need no torchvision."""

from __future__ import annotations

import json

import pytest
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
from transformers.video_utils import VideoMetadata

from encoders.video_processing import Qwen3VLVideoProcessing, SamplingRequest, VideoMeta
from schemas import InvalidRequest, VideoArgs

TOTAL_PIXELS = VideoArgs().total_pixels

# (frames, source fps, width, height, fps or None)
CASES = [
    (24, 8.0, 160, 120, None),  # the parity tests' video: 6 frames, 3 tubelets
    (20, 8.0, 64, 48, None),  # 2.5 s: 5 frames, odd: the last repeats
    (300, 30.0, 640, 360, None),
    (300, 29.97, 1280, 720, 1.0),
    (9, 24.0, 320, 240, None),  # shorter than 4 frames at 2 fps: 4
    (3, 24.0, 320, 240, None),  # fewer than 4: all 3, odd
    (24000, 24.0, 320, 240, None),  # 1000 s: 768 at most
    (101, 10.0, 100, 3000, 0.5),  # tall
    (50, 25.0, 33, 17, None),  # frames smaller than the factor: scaled up first
]
SIZES = [
    {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32},
    {"shortest_edge": 4096, "longest_edge": 25165824},
]


@pytest.mark.parametrize("cap", [False, True])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("total,video_fps,width,height,fps", CASES)
def test_plan_equals_transformers(total, video_fps, width, height, fps, size, cap):
    ours = Qwen3VLVideoProcessing(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"],
                                  cap_pixels_per_frame=cap)  # fmt: skip
    theirs = Qwen3VLVideoProcessor(size=size, cap_pixels_per_frame=cap)
    plan = ours.plan(VideoMeta(total, video_fps, width, height), SamplingRequest(fps=fps), TOTAL_PIXELS)

    indices = theirs.sample_frames(VideoMetadata(total_num_frames=total, fps=video_fps), fps=fps).tolist()
    n = len(indices)
    padded = indices + indices[-1:] * (n % 2)  # patchify repeats the last frame to the temporal patch
    assert list(plan.indices) == padded
    patches = theirs.get_num_of_video_patches(n, height, width, {"size": size})
    assert plan.grid_thw[0] * plan.grid_thw[1] * plan.grid_thw[2] == patches
    assert plan.num_tokens == patches // 4
    # The frame size from the resize's own formula (the budget as its `resize` works it out).
    budget = size["longest_edge"]
    if cap:
        budget = max(min(768 * 32 * 32, budget // n), int(size["shortest_edge"] * 1.05)) * n
    h, w = smart_resize(n, height, width, 2, 32, size["shortest_edge"], budget)
    assert (plan.width, plan.height) == (w, h) and plan.grid_thw == ((n + n % 2) // 2, h // 16, w // 16)
    expected = Qwen3VLProcessor._calculate_timestamps(None, list(indices), video_fps, 2)
    assert plan.timestamps == pytest.approx(expected, abs=1e-12)


def test_known_plan_and_its_prompt_text():
    """Hand-checked: 24 frames at 8 fps, sampled at 2: frames 0, 5, 9, 14, 18, 23 in three tubelets at 0.3, 1.4
    and 2.6 s; a 160x120 video within 6 x 96 x 128 pixels is 128x96 frames."""
    proc = Qwen3VLVideoProcessing(min_pixels=4096, max_pixels=6 * 96 * 128)
    plan = proc.plan(VideoMeta(24, 8.0, 160, 120), SamplingRequest(), TOTAL_PIXELS)
    assert plan.indices == (0, 5, 9, 14, 18, 23) and (plan.width, plan.height) == (128, 96)
    assert plan.grid_thw == (3, 6, 8) and plan.num_tokens == 36
    assert [proc.timestamp_text(t) for t in plan.timestamps] == ["<0.3 seconds>", "<1.4 seconds>", "<2.6 seconds>"]
    assert plan.chunk(1, 3).timestamps == plan.timestamps[1:]


def test_frame_list_is_taken_at_the_requests_fps():
    proc = Qwen3VLVideoProcessing(min_pixels=4096, max_pixels=6 * 96 * 128)
    plan = proc.frame_list_plan(VideoMeta(5, 1.0, 90, 60), SamplingRequest(fps=1.0), TOTAL_PIXELS)
    assert plan.indices == (0, 1, 2, 3, 4, 4) and plan.timestamps == (0.5, 2.5, 4.0)
    default = proc.frame_list_plan(VideoMeta(4, 2.0, 90, 60), SamplingRequest(), TOTAL_PIXELS)
    assert default.timestamps == (0.25, 1.25)  # 2 frames a second
    # One frame (transformers refuses fewer than two): sized as the two copies of it that are encoded
    one = proc.frame_list_plan(VideoMeta(1, 2.0, 64, 48), SamplingRequest(), TOTAL_PIXELS)
    two = proc.frame_list_plan(VideoMeta(2, 2.0, 64, 48), SamplingRequest(), TOTAL_PIXELS)
    assert one.indices == (0, 0) and one.grid_thw == two.grid_thw == (1, 4, 4)


def test_request_bounds_and_errors():
    proc, meta = Qwen3VLVideoProcessing(), VideoMeta(300, 30.0, 640, 360)
    assert len(proc.plan(meta, SamplingRequest(fps=1.0), TOTAL_PIXELS).indices) == 10
    small = proc.plan(meta, SamplingRequest(max_pixels=32 * 32 * 4), TOTAL_PIXELS)
    assert small.width * small.height <= 32 * 32 * 4
    tight = proc.plan(meta, SamplingRequest(total_pixels=20 * 32 * 32 * 8), TOTAL_PIXELS)
    assert 20 * tight.width * tight.height <= 20 * 32 * 32 * 8
    assert len(proc.plan(meta, SamplingRequest(nframes=7), TOTAL_PIXELS).indices) == 8  # odd: padded
    with pytest.raises(InvalidRequest, match="video sampling gives 400 frames; it must be 2 to the video's 300"):
        proc.plan(meta, SamplingRequest(nframes=400), TOTAL_PIXELS)
    with pytest.raises(InvalidRequest, match="it must be 2 to the video's 1 frames"):
        proc.plan(VideoMeta(1, 30.0, 64, 64), SamplingRequest(), TOTAL_PIXELS)


def test_checkpoint_video_config(tmp_path):
    assert Qwen3VLVideoProcessing.from_pretrained(tmp_path) == Qwen3VLVideoProcessing()  # transformers' defaults
    cfg = {"size": {"shortest_edge": 4096, "longest_edge": 25165824}, "fps": 1.0, "cap_pixels_per_frame": True,
           "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}  # fmt: skip
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(cfg))
    proc = Qwen3VLVideoProcessing.from_pretrained(tmp_path)
    assert (proc.min_pixels, proc.max_pixels, proc.fps, proc.cap_pixels_per_frame) == (4096, 25165824, 1.0, True)
    assert proc.patch_size == 16 and proc.fingerprint() != Qwen3VLVideoProcessing().fingerprint()
