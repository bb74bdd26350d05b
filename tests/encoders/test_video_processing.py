"""Video sampling and preprocessing against their references: qwen-vl-utils' fetch_video (frame count, indices, the
per-frame pixel budget), transformers' Qwen2VLImageProcessorPil (the frame resize, checked on images) and
Qwen2VLVideoProcessor's patch layout (its module needs torchvision, which cannot load beside this CPU torch: the
layout is restated here from its `patchify`, and the resize is the image processor's PIL bicubic, not torchvision's)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from encoders.video_decode import decode_frames
from encoders.video_processing import Qwen2VLVideoProcessing, SamplingRequest, VideoMeta
from schemas import InvalidRequest, VideoArgs
from tests.helpers import image_bytes, make_image

TOTAL_PIXELS = VideoArgs().total_pixels


def qwen_nframes(total: int, video_fps: float, fps: float = 2.0, nframes: int | None = None) -> int:
    """qwen-vl-utils' smart_nframes, restated from its description in issue 23 (FRAME_FACTOR 2, 4 to 768)."""
    if nframes is not None:
        return round(nframes / 2) * 2
    n = total / video_fps * fps
    n = min(max(n, 4), math.floor(min(768, total) / 2) * 2, total)
    return math.floor(n / 2) * 2


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
    # Per-frame budget: max(min(768*28*28, total_pixels/n*2), 1.05*128*28*28); then transformers' smart_resize.
    budget = max(min(768 * 28 * 28, TOTAL_PIXELS * 2 // n), int(128 * 28 * 28 * 1.05))
    h, w = _transformers_smart_resize(height, width, 28, 128 * 28 * 28, budget)
    assert (plan.width, plan.height) == (w, h)
    # Grid and tokens: transformers' get_num_of_video_patches, and one token per 2x2 patches.
    assert plan.grid_thw == (n // 2, h // 14, w // 14)
    assert plan.num_tokens == (n // 2) * (h // 14) * (w // 14) // 4


def _transformers_smart_resize(height, width, factor, min_pixels, max_pixels):
    # The rule of transformers' smart_resize, through the image processor that carries it.
    proc = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    image = Image.new("RGB", (width, height))
    _, gh, gw = proc(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    return gh * 14, gw * 14


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


def _reference_rows(frames: list[Image.Image], size: tuple[int, int]) -> torch.Tensor:
    """transformers' video rows: each frame resized (bicubic, the resize checked on images above) and normalized by
    the image processor (its output for one frame holds it T times), then laid out as
    Qwen2VLVideoProcessor.patchify: (t, T, C, gh/m, m, p, gw/m, m, p) permuted (t, gh/m, gw/m, m, m, C, T, p, p)."""
    w, h = size
    proc = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=w * h)  # the frame's own size: no resize
    frames = [f.resize(size, resample=Image.Resampling.BICUBIC) for f in frames]
    per_frame = [proc(images=[f], return_tensors="pt")["pixel_values"].view(-1, 3, 2, 14 * 14)[:, :, 0] for f in frames]
    gh, gw = h // 14, w // 14
    # per_frame rows are already in merge order; undo that to the plain (C, h, w) frame, then patchify as transformers
    x = torch.stack(per_frame).view(len(frames), gh // 2, gw // 2, 2, 2, 3, 14, 14)  # (n, gh/m, gw/m, m, m, C, p, p)
    x = x.permute(0, 5, 1, 3, 6, 2, 4, 7).reshape(len(frames), 3, h, w)  # (n, C, h, w)
    t = len(frames) // 2
    patches = x.reshape(1, t, 2, 3, gh // 2, 2, 14, gw // 2, 2, 14)
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)  # transformers' patchify permutation
    return patches.reshape(t * gh * gw, 3 * 2 * 14 * 14)


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
    expected = _reference_rows([frames[i] for i in plan.indices], (plan.width, plan.height))
    torch.testing.assert_close(pixel_values, expected, rtol=0, atol=1e-5)
