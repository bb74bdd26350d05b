"""The reference side of video tests, written apart from the server's code: qwen-vl-utils' sampling restated from
issue 23, frames decoded by PyAV, resized by PIL's bicubic and normalized by transformers' Qwen2VLImageProcessorPil
(the resize checked on images in tests/encoders/test_video_processing.py), laid out as transformers'
Qwen2VLVideoProcessor.patchify (restated: its module needs torchvision, which cannot load beside this CPU torch)."""

from __future__ import annotations

import io
import math

import av
import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tests.helpers import video_frames

VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS, TOTAL_PIXELS = 128 * 28 * 28, 768 * 28 * 28, int(128000 * 28 * 28 * 0.9)


def qwen_nframes(total: int, video_fps: float, fps: float = 2.0, nframes: int | None = None) -> int:
    """qwen-vl-utils' smart_nframes (FRAME_FACTOR 2, 4 to 768 frames)."""
    if nframes is not None:
        return round(nframes / 2) * 2
    n = total / video_fps * fps
    n = min(max(n, 4), math.floor(min(768, total) / 2) * 2, total)
    return math.floor(n / 2) * 2


def frame_size(width: int, height: int, n: int, min_pixels: int = VIDEO_MIN_PIXELS, max_pixels: int | None = None):
    """(width, height) of each of n frames: the per-frame budget of qwen-vl-utils' fetch_video, then transformers'
    smart_resize (through the image processor that carries it)."""
    budget = max(min(VIDEO_MAX_PIXELS, TOTAL_PIXELS * 2 // n), int(min_pixels * 1.05))
    budget = min(budget, max_pixels) if max_pixels is not None else budget
    proc = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=budget)
    _, gh, gw = proc(images=[Image.new("RGB", (width, height))], return_tensors="pt")["image_grid_thw"][0].tolist()
    return gw * 14, gh * 14


def patchify(frames: list[Image.Image], size: tuple[int, int]) -> torch.Tensor:
    """pixel_values_videos of frames: each resized (bicubic) and normalized by the image processor (whose output for
    one frame holds it twice), laid out as Qwen2VLVideoProcessor.patchify: (t, T, C, gh/m, m, p, gw/m, m, p) permuted
    to (t, gh/m, gw/m, m, m, C, T, p, p)."""
    w, h = size
    proc = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=w * h)  # the frame's own size: no resize
    frames = [f.resize(size, resample=Image.Resampling.BICUBIC) for f in frames]
    per_frame = [proc(images=[f], return_tensors="pt")["pixel_values"].view(-1, 3, 2, 14 * 14)[:, :, 0] for f in frames]
    gh, gw = h // 14, w // 14
    x = torch.stack(per_frame).view(len(frames), gh // 2, gw // 2, 2, 2, 3, 14, 14)  # (n, gh/m, gw/m, m, m, C, p, p)
    x = x.permute(0, 5, 1, 3, 6, 2, 4, 7).reshape(len(frames), 3, h, w)  # back to plain frames (n, C, h, w)
    t = len(frames) // 2
    patches = x.reshape(1, t, 2, 3, gh // 2, 2, 14, gw // 2, 2, 14)
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)  # transformers' patchify permutation
    return patches.reshape(t * gh * gw, 3 * 2 * 14 * 14)


def reference_video(data: bytes, fps: float | None = None, min_pixels: int = VIDEO_MIN_PIXELS,
                    max_pixels: int | None = None) -> tuple[torch.Tensor, tuple[int, int, int], float]:  # fmt: skip
    """A container's (pixel_values_videos, video_grid_thw, second_per_grid_t), as qwen-vl-utils + transformers."""
    frames = video_frames(data)
    with av.open(io.BytesIO(data)) as container:
        video_fps = float(container.streams.video[0].average_rate)
    n = qwen_nframes(len(frames), video_fps, fps or 2.0)
    indices = np.round(np.linspace(0, len(frames) - 1, n, dtype=np.float32)).astype(int)
    size = frame_size(frames[0].width, frames[0].height, n, min_pixels, max_pixels)
    sample_fps = n / len(frames) * video_fps
    return patchify([frames[i] for i in indices], size), (n // 2, size[1] // 14, size[0] // 14), 2 / sample_fps


def reference_qwen3_video(data: bytes, checkpoint) -> tuple[torch.Tensor, tuple[int, int, int], str]:
    """A container's (pixel_values_videos, video_grid_thw, placeholder text) as transformers' Qwen3-VL processors make
    them: Qwen3VLVideoProcessor's frame sampling, its resize's size and its patchify (the resize itself PIL's bicubic,
    the normalization its image processor's: torchvision cannot load here), and Qwen3VLProcessor's text for the
    video, each tubelet's `<t seconds>` and run (its methods called on a stand-in for the processor, whose
    constructor needs torchvision)."""
    import json
    from functools import partial
    from pathlib import Path
    from types import SimpleNamespace

    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
    from transformers.video_utils import VideoMetadata

    cfg = json.loads((Path(checkpoint) / "video_preprocessor_config.json").read_text())
    proc = Qwen3VLVideoProcessor(**{k: v for k, v in cfg.items() if not k.endswith(("_type", "_class"))})
    frames = video_frames(data)
    with av.open(io.BytesIO(data)) as container:
        video_fps = float(container.streams.video[0].average_rate)
    meta = VideoMetadata(total_num_frames=len(frames), fps=video_fps)
    indices = proc.sample_frames(meta).tolist()
    h, w = smart_resize(len(indices), frames[0].height, frames[0].width, 2, 32, proc.size.shortest_edge,
                        proc.size.longest_edge)  # fmt: skip
    image_proc = Qwen2VLImageProcessorPil(
        min_pixels=32 * 32, max_pixels=w * h, patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )  # the frame's size: no resize
    resized = [frames[i].resize((w, h), resample=Image.Resampling.BICUBIC) for i in indices]
    gh, gw = h // 16, w // 16
    per_frame = [image_proc(images=[f], return_tensors="pt")["pixel_values"].view(-1, 3, 2, 16 * 16)[:, :, 0]
                 for f in resized]  # fmt: skip
    x = torch.stack(per_frame).view(len(resized), gh // 2, gw // 2, 2, 2, 3, 16, 16)
    x = x.permute(0, 5, 1, 3, 6, 2, 4, 7).reshape(1, len(resized), 3, h, w)  # plain frames again (1, n, C, h, w)
    pixel_values, t, gh, gw = proc.patchify(x, patch_size=16, merge_size=2, temporal_patch_size=2)
    stand_in = SimpleNamespace(video_processor=proc, vision_start_token="<|vision_start|>",
                               video_token="<|video_pad|>", vision_end_token="<|vision_end|>")  # fmt: skip
    stand_in._calculate_timestamps = partial(Qwen3VLProcessor._calculate_timestamps, stand_in)
    meta.frames_indices = indices
    text = Qwen3VLProcessor.replace_video_token(
        stand_in, {"video_grid_thw": torch.tensor([[t, gh, gw]]), "video_metadata": [meta]}, 0
    )
    return pixel_values[0], (t, gh, gw), text
