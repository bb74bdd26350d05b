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
