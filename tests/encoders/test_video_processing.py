"""Video sampling and preprocessing against their references: qwen-vl-utils' fetch_video (frame count, indices, the
per-frame pixel budget), transformers' Qwen2VLImageProcessorPil (the frame resize, checked on images) and
Qwen2VLVideoProcessor's patch layout (its module needs torchvision, which cannot load beside this CPU torch: the
layout is restated here from its `patchify`, and the resize is the image processor's PIL bicubic, not torchvision's)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from demo.inputs import image_bytes, make_image
from encoders.video_decode import decode_frames
from encoders.video_processing import Qwen2VLVideoProcessing, SamplingRequest, VideoMeta
from schemas import InvalidRequest, VideoArgs
from tests.video_reference import frame_size, patchify, qwen_nframes

TOTAL_PIXELS = VideoArgs().total_pixels


# (frames, source fps, width, height, fps or None, nframes or None)
CASES = [
    (20, 8.0, 64, 48, None, None),  # 2.5 s: 5 frames at 2 fps -> 4
    (300, 30.0, 640, 360, None, None),  # 10 s -> 20
    (300, 29.97, 1280, 720, 1.0, None),  # a 0.1-second tail
    (9, 24.0, 320, 240, None, None),  # shorter than 4 frames at 2 fps: at least 4
    (3, 24.0, 320, 240, None, None),  # fewer frames than 4: all it has, even: 2
    (24000, 24.0, 320, 240, None, None),  # 1000 s: 768 at most
    (600, 60.0, 1920, 1080, 4.0, None),
    (101, 10.0, 100, 3000, 0.5, None),  # tall
    (120, 30.0, 426, 240, None, 7),  # nframes rounds to even: 8
    (50, 25.0, 33, 17, None, 16),  # tiny frames: up to min_pixels
]


@pytest.mark.parametrize("total,video_fps,width,height,fps,nframes", CASES)
def test_sampling_equals_qwen_vl_utils(total, video_fps, width, height, fps, nframes):
    proc = Qwen2VLVideoProcessing()
    meta = VideoMeta(total, video_fps, width, height)
    plan = proc.plan(meta, SamplingRequest(fps=fps, nframes=nframes), TOTAL_PIXELS)
    n = qwen_nframes(total, video_fps, fps or 2.0, nframes)
    assert len(plan.indices) == n
    assert list(plan.indices) == np.round(np.linspace(0, total - 1, n, dtype=np.float32)).astype(int).tolist()
    assert plan.sample_fps == pytest.approx(n / total * video_fps)
    assert plan.second_per_grid_t == pytest.approx(2 / plan.sample_fps)
    w, h = frame_size(width, height, n)  # qwen-vl-utils' per-frame budget, then transformers' smart_resize
    assert (plan.width, plan.height) == (w, h)
    # Grid and tokens: transformers' get_num_of_video_patches, and one token per 2x2 patches.
    assert plan.grid_thw == (n // 2, h // 14, w // 14)
    assert plan.num_tokens == (n // 2) * (h // 14) * (w // 14) // 4


def test_known_plans():
    """Hand-checked: 10 s of 30 fps at the default 2 fps is 20 frames, 0, 15.7, ... rounded."""
    plan = Qwen2VLVideoProcessing().plan(VideoMeta(300, 30.0, 640, 360), SamplingRequest(), TOTAL_PIXELS)
    assert plan.indices[:4] == (0, 16, 31, 47) and plan.indices[-1] == 299 and len(plan.indices) == 20
    assert (plan.width, plan.height) == (644, 364) and plan.grid_thw == (10, 26, 46) and plan.num_tokens == 2990
    assert plan.sample_fps == 2.0 and plan.second_per_grid_t == 1.0


def test_request_settings_and_errors():
    proc, meta = Qwen2VLVideoProcessing(), VideoMeta(300, 30.0, 640, 360)
    assert len(proc.plan(meta, SamplingRequest(fps=1.0), TOTAL_PIXELS).indices) == 10
    small = proc.plan(meta, SamplingRequest(max_pixels=28 * 28 * 16), TOTAL_PIXELS)
    assert small.width * small.height <= 28 * 28 * 16
    tight = proc.plan(meta, SamplingRequest(total_pixels=20 * 28 * 28 * 64), TOTAL_PIXELS)
    assert tight.width * tight.height <= max(28 * 28 * 64 * 2, int(128 * 28 * 28 * 1.05))
    with pytest.raises(InvalidRequest, match="video sampling gives 400 frames; it must be 2 to the video's 300"):
        proc.plan(meta, SamplingRequest(nframes=400), TOTAL_PIXELS)
    with pytest.raises(InvalidRequest, match="it must be 2 to the video's 1 frames"):
        proc.plan(VideoMeta(1, 30.0, 64, 64), SamplingRequest(), TOTAL_PIXELS)


def test_checkpoint_video_config_wins_and_its_absence_is_never_the_image_budget(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12845056}))
    assert Qwen2VLVideoProcessing.from_pretrained(tmp_path) == Qwen2VLVideoProcessing()  # qwen-vl-utils' video budget
    cfg = {"size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 16 * 28 * 28}, "temporal_patch_size": 2, "fps": 1.0}
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(cfg))
    proc = Qwen2VLVideoProcessing.from_pretrained(tmp_path)
    assert (proc.min_pixels, proc.max_pixels, proc.fps) == (4 * 28 * 28, 16 * 28 * 28, 1.0)


@pytest.mark.parametrize("size", [(64, 48), (300, 140), (17, 200), (640, 360)])
def test_frame_preprocessing_equals_the_image_processor_on_images(size):
    """The re-implemented resize, checked on images: a video of one frame twice is that image to the image
    processor at the same pixel budget."""
    proc = Qwen2VLVideoProcessing()
    image = make_image(*size, seed=3)
    plan = proc.frame_list_plan(VideoMeta(2, 2.0, *size), SamplingRequest(), TOTAL_PIXELS)
    pixel_values, grid = proc.preprocess(decode_frames([image_bytes(image)] * 2, plan))
    w, h = plan.width, plan.height
    expected = Qwen2VLImageProcessorPil(min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28)(
        images=[image], return_tensors="pt"
    )
    assert grid == tuple(expected["image_grid_thw"][0].tolist()) == (1, h // 14, w // 14)
    torch.testing.assert_close(pixel_values, expected["pixel_values"], rtol=0, atol=1e-5)


def test_video_rows_follow_transformers_layout():
    proc = Qwen2VLVideoProcessing()
    frames = [make_image(90, 60, seed=s) for s in range(5)]  # odd: the last one repeats
    plan = proc.frame_list_plan(VideoMeta(5, 2.0, 90, 60), SamplingRequest(), TOTAL_PIXELS)
    assert plan.indices == (0, 1, 2, 3, 4, 4)
    pixel_values, grid = proc.preprocess(decode_frames([image_bytes(f) for f in frames], plan))
    assert grid == plan.grid_thw == (3, plan.height // 14, plan.width // 14)
    expected = patchify([frames[i] for i in plan.indices], (plan.width, plan.height))
    torch.testing.assert_close(pixel_values, expected, rtol=0, atol=1e-5)
