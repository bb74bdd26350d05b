"""Qwen2-VL video: the sampling plan (how many frames, which ones, their size, the grid and the token count) from the
container's metadata alone, and the preprocessing of the sampled frames. The one place of the formula: the ingress
counts a video's tokens with it before any decoding, and the encoder samples and resizes with the same plan."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from encoders.qwen2_vl import _CLIP_MEAN, _CLIP_STD, smart_resize
from schemas import InvalidRequest


@dataclass(frozen=True, slots=True)
class VideoMeta:
    """What the ingress reads from the container (or from a frame list's first image header)."""

    num_frames: int
    fps: float  # the source's frames per second
    width: int
    height: int


@dataclass(frozen=True, slots=True)
class VideoPlan:
    """A video's sampling, worked out before any pixel is decoded."""

    indices: tuple[int, ...]  # the source frames to take, in order (a frame list pads by repeating its last)
    sample_fps: float  # frames per second of the sampled video
    width: int  # every sampled frame is resized to this
    height: int
    grid_thw: tuple[int, int, int]  # (tubelets, patch rows, patch columns)
    num_tokens: int
    second_per_grid_t: float  # seconds per tubelet: Qwen2.5-VL's temporal positions
    # Qwen3-VL: each tubelet's time in seconds, written in the prompt before its run of tokens; (): none (Qwen2-VL)
    timestamps: tuple[float, ...] = ()

    def chunks(self, max_patches: int) -> list[tuple[int, int]]:
        """Tubelet ranges [a, b) of at most `max_patches` patches each (one tubelet at least), in order. Qwen's ViTs
        attend within a frame's tubelet only (cu_seqlens per tubelet; Qwen2.5-VL's windows too) and place patches by
        row and column alone, so encoding the chunks apart and concatenating equals encoding the whole video."""
        t, h, w = self.grid_thw
        step = max(1, max_patches // (h * w))
        return [(a, min(a + step, t)) for a in range(0, t, step)]

    def chunk(self, a: int, b: int) -> VideoPlan:
        """The plan of tubelets [a, b): their frames, grid and tokens."""
        t, h, w = self.grid_thw
        per = len(self.indices) // t  # frames per tubelet (temporal_patch_size)
        tokens = self.num_tokens * (b - a) // t
        return replace(
            self,
            indices=self.indices[a * per : b * per],
            grid_thw=(b - a, h, w),
            num_tokens=tokens,
            timestamps=self.timestamps[a:b],
        )


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """A request's sampling settings (mm_processor_kwargs), already clamped to the server's (deployments/ingress)."""

    fps: float | None = None
    nframes: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None


@dataclass(frozen=True, slots=True)
class Qwen2VLVideoProcessing:
    """Qwen2-VL's video processing: qwen-vl-utils' `fetch_video` sampling and per-frame pixel budget, and
    transformers' `Qwen2VLVideoProcessor` patch layout. Defaults are qwen-vl-utils' VIDEO_MIN/MAX_PIXELS."""

    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    image_mean: tuple[float, float, float] = _CLIP_MEAN
    image_std: tuple[float, float, float] = _CLIP_STD

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Qwen2VLVideoProcessing:
        """video_preprocessor_config.json where the checkpoint has one; else qwen-vl-utils' video defaults, never
        the image budget (preprocessor_config.json's max_pixels would give every frame an image's tokens)."""
        path = Path(model_dir) / "video_preprocessor_config.json"
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        size, d = cfg.get("size") or {}, cls()
        return cls(
            min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge") or d.min_pixels),
            max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge") or d.max_pixels),
            **d._sampling_fields(cfg),
        )

    def _sampling_fields(self, cfg: dict) -> dict:
        """The fields both families read alike from video_preprocessor_config.json, these defaults where absent."""
        return dict(
            patch_size=int(cfg.get("patch_size", self.patch_size)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", self.temporal_patch_size)),
            merge_size=int(cfg.get("merge_size", self.merge_size)),
            fps=float(cfg.get("fps") or self.fps),
            min_frames=int(cfg.get("min_frames", self.min_frames)),
            max_frames=int(cfg.get("max_frames", self.max_frames)),
            image_mean=tuple(cfg.get("image_mean", self.image_mean)),
            image_std=tuple(cfg.get("image_std", self.image_std)),
        )

    def fingerprint(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    def num_frames(self, meta: VideoMeta, fps: float | None = None, nframes: int | None = None) -> int:
        """Frames to sample: qwen-vl-utils' smart_nframes (and transformers' sample_frames): `nframes` rounded to
        the temporal patch, else the video's length at `fps` (2 by default) within [min_frames, max_frames] and the
        frames it has, floored to the temporal patch."""
        T, total = self.temporal_patch_size, meta.num_frames
        if nframes is not None:
            n = round(nframes / T) * T
        else:
            lo = math.ceil(self.min_frames / T) * T
            hi = math.floor(min(self.max_frames, total) / T) * T
            n = math.floor(min(max(total / meta.fps * (fps or self.fps), lo), hi, total) / T) * T
        if not T <= n <= total:
            raise InvalidRequest(f"video sampling gives {n} frames; it must be {T} to the video's {total} frames")
        return n

    def frame_size(self, meta: VideoMeta, n: int, req: SamplingRequest, total_pixels: int) -> tuple[int, int]:
        """(width, height) of every sampled frame: smart_resize within the per-frame budget of qwen-vl-utils'
        fetch_video, max(min(max_pixels, total_pixels * 2 / n), 1.05 * min_pixels), then the request's max_pixels."""
        factor = self.patch_size * self.merge_size
        min_pixels = min(req.min_pixels or self.min_pixels, self.max_pixels)
        total = min(req.total_pixels or total_pixels, total_pixels)
        # NOTE: integer division as transformers' Qwen2VLVideoProcessor.resize (cap_pixels_per_frame); qwen-vl-utils
        # divides in floats: the budgets differ by under one pixel.
        max_pixels = max(min(self.max_pixels, total * self.temporal_patch_size // n), int(min_pixels * 1.05))
        if req.max_pixels is not None:
            max_pixels = min(max_pixels, req.max_pixels)
        h, w = smart_resize(meta.height, meta.width, factor, min_pixels, max_pixels)
        return w, h

    def plan(self, meta: VideoMeta, req: SamplingRequest, total_pixels: int) -> VideoPlan:
        """A container's video: `n` frames at linspace(0, total - 1, n).round() (qwen-vl-utils' indices, in
        torch's float32 linspace and round-half-even, as there)."""
        n = self.num_frames(meta, req.fps, req.nframes)
        indices = torch.linspace(0, meta.num_frames - 1, n).round().long().tolist()
        return self._plan(meta, req, total_pixels, tuple(indices), n / max(meta.num_frames, 1e-6) * meta.fps)

    def frame_list_plan(self, meta: VideoMeta, req: SamplingRequest, total_pixels: int) -> VideoPlan:
        """A video given as its frames: all of them, padded to the temporal patch by repeating the last one, at
        the request's fps or 2 (qwen-vl-utils' frame-list branch; its frames get the video budget here)."""
        T, total = self.temporal_patch_size, meta.num_frames
        n = math.ceil(total / T) * T
        indices = tuple(range(total)) + (total - 1,) * (n - total)
        return self._plan(meta, req, total_pixels, indices, req.fps or self.fps)

    def _plan(
        self, meta: VideoMeta, req: SamplingRequest, total_pixels: int, indices: tuple[int, ...], sample_fps: float
    ) -> VideoPlan:
        n, p = len(indices), self.patch_size
        w, h = self.frame_size(meta, n, req, total_pixels)
        grid = (n // self.temporal_patch_size, h // p, w // p)
        num_tokens = grid[0] * grid[1] * grid[2] // self.merge_size**2
        # Qwen2.5-VL: temporal_patch_size / the sampled fps (transformers' processor: metadata.sampled_fps).
        return VideoPlan(indices, sample_fps, w, h, grid, num_tokens, self.temporal_patch_size / sample_fps)

    def preprocess(self, frames: np.ndarray) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Sampled frames (n, h, w, 3) uint8, already resized -> (pixel_values (t*gh*gw, C*T*p*p), grid (t, gh, gw)).

        Rows as transformers' Qwen2VLVideoProcessor.patchify lays them out: tubelet-major, then the image
        processor's merge order, each row (C, T, p, p) with the tubelet's T frames. The same float32 ops in the same
        order as Qwen2VLImageProcessing.preprocess (an image is a tubelet of T copies of one frame)."""
        p, m, T = self.patch_size, self.merge_size, self.temporal_patch_size
        n, h, w, _ = frames.shape
        assert n % T == 0 and h % (p * m) == 0 and w % (p * m) == 0, frames.shape
        t, gh, gw = n // T, h // p, w // p
        x = frames.reshape(t, T, gh // m, m, p, gw // m, m, p, 3)  # (t, T, gh/m, m, p, gw/m, m, p, C)
        x = np.ascontiguousarray(x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7))  # (t, gh/m, gw/m, m, m, C, T, p, p)
        x = torch.from_numpy(x.astype(np.float32)).view(t * gh * gw, 3, T, p * p)  # (rows, C, T, p*p)
        mean = torch.tensor(self.image_mean, dtype=torch.float32).view(1, 3, 1, 1)
        std = torch.tensor(self.image_std, dtype=torch.float32).view(1, 3, 1, 1)
        x.div_(255.0).sub_(mean).div_(std)
        return x.view(t * gh * gw, 3 * T * p * p), (t, gh, gw)  # (rows, C*T*p*p)


def qwen3_smart_resize(
    num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) of every frame: both multiples of `factor`, the whole video's pixels (frames rounded to the
    temporal factor) within [min_pixels, max_pixels]; frames smaller than `factor` scaled up first."""
    # Adapted from smart_resize in transformers/models/qwen3_vl/video_processing_qwen3_vl.py (same rounding, so the
    # same counts; Python's round, half to even, as there).
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        ratio = max(height, width) / min(height, width)
        raise InvalidRequest(f"video aspect ratio must be at most 200, got {ratio:.1f}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True, slots=True)
class Qwen3VLVideoProcessing(Qwen2VLVideoProcessing):
    """Qwen3-VL's video processing, as transformers' Qwen3VLVideoProcessor does it: `fps` frames a second within
    [min_frames, max_frames] (not rounded to the temporal patch: an odd count repeats its last frame), at
    linspace(0, total - 1, n).round(); one pixel budget for the whole video (`min_pixels` and `max_pixels` are its
    size.shortest_edge and size.longest_edge, over all frames), capped per frame where the checkpoint asks
    (cap_pixels_per_frame, as qwen-vl-utils); each tubelet's time, the mean of its frames' times, is written in
    the prompt before its tokens (the processor's `<t seconds>`). Patch 16, ImageNet's mean and std of 0.5."""

    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 768 * 32 * 32
    patch_size: int = 16
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    cap_pixels_per_frame: bool = False  # transformers 5.23's default where the checkpoint does not say
    max_video_tokens: int = 768  # the per-frame cap, in tokens of (patch_size * merge_size)**2 pixels

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Qwen3VLVideoProcessing:
        path = Path(model_dir) / "video_preprocessor_config.json"
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        size, d = cfg.get("size") or {}, cls()
        return cls(
            min_pixels=int(size.get("shortest_edge", d.min_pixels)),
            max_pixels=int(size.get("longest_edge", d.max_pixels)),
            **d._sampling_fields(cfg),
            cap_pixels_per_frame=bool(cfg.get("cap_pixels_per_frame") or False),
            max_video_tokens=int(cfg.get("max_video_tokens", d.max_video_tokens)),
        )

    def num_frames(self, meta: VideoMeta, fps: float | None = None, nframes: int | None = None) -> int:
        """transformers' Qwen3VLVideoProcessor.sample_frames: `nframes` as given, else int(seconds * fps) within
        [min_frames, max_frames] and the frames the video has."""
        total = meta.num_frames
        if nframes is not None:
            n = nframes
        else:
            n = min(max(int(total / meta.fps * (fps or self.fps)), self.min_frames), self.max_frames, total)
        if not self.temporal_patch_size <= n <= total:
            raise InvalidRequest(
                f"video sampling gives {n} frames; it must be {self.temporal_patch_size} to the video's {total} frames"
            )
        return n

    def frame_size(self, meta: VideoMeta, n: int, req: SamplingRequest, total_pixels: int) -> tuple[int, int]:
        """(width, height) of every sampled frame: Qwen3-VL's smart_resize over the whole video's budget (the
        checkpoint's, then the server's and the request's total_pixels, the request's max_pixels a frame)."""
        factor = self.patch_size * self.merge_size
        budget = min(self.max_pixels, req.total_pixels or total_pixels, total_pixels)
        if self.cap_pixels_per_frame:  # as transformers' resize: the budget's share a frame, within the cap
            per_frame = max(min(self.max_video_tokens * factor * factor, budget // n), int(self.min_pixels * 1.05))
            budget = per_frame * n
        if req.max_pixels is not None:
            budget = min(budget, req.max_pixels * n)
        min_pixels = self.min_pixels if req.min_pixels is None else min(req.min_pixels * n, budget)
        h, w = qwen3_smart_resize(n, meta.height, meta.width, self.temporal_patch_size, factor, min_pixels, budget)
        return w, h

    def plan(self, meta: VideoMeta, req: SamplingRequest, total_pixels: int) -> VideoPlan:
        """`n` frames at numpy's linspace(0, total - 1, n).round() (float64, half to even, as transformers),
        padded to the temporal patch with the last; timestamps at the container's frame rate."""
        n = self.num_frames(meta, req.fps, req.nframes)
        indices = np.linspace(0, meta.num_frames - 1, n).round().astype(int).tolist()
        return self._timed_plan(meta, req, total_pixels, indices, n / max(meta.num_frames, 1e-6) * meta.fps, meta.fps)

    def frame_list_plan(self, meta: VideoMeta, req: SamplingRequest, total_pixels: int) -> VideoPlan:
        """A video given as its frames: all of them, taken as sampled at the request's fps or `fps` (2), which
        their timestamps count in."""
        fps = req.fps or self.fps
        return self._timed_plan(meta, req, total_pixels, list(range(meta.num_frames)), fps, fps)

    def _timed_plan(
        self, meta: VideoMeta, req: SamplingRequest, total_pixels: int, indices: list[int], sample_fps: float,
        source_fps: float,
    ) -> VideoPlan:  # fmt: skip
        n, T = len(indices), self.temporal_patch_size
        # The sampled count, before padding, as transformers sizes it; a one-frame list (which transformers refuses)
        # as the two copies of it that are encoded.
        w, h = self.frame_size(meta, max(n, T), req, total_pixels)
        indices = tuple(indices) + (indices[-1],) * (-n % T)  # patchify's padding: the last frame repeated
        # transformers' Qwen3VLProcessor._calculate_timestamps: each tubelet at the mean of its first and last frame
        times = [i / source_fps for i in indices]
        timestamps = tuple((times[k] + times[k + T - 1]) / 2 for k in range(0, len(times), T))
        p = self.patch_size
        grid = (len(indices) // T, h // p, w // p)
        num_tokens = grid[0] * grid[1] * grid[2] // self.merge_size**2
        return VideoPlan(indices, sample_fps, w, h, grid, num_tokens, T / sample_fps, timestamps)

    @staticmethod
    def timestamp_text(seconds: float) -> str:
        """A tubelet's time as the prompt writes it before its tokens (transformers' Qwen3VLProcessor)."""
        return f"<{seconds:.1f} seconds>"


__all__ = ["Qwen2VLVideoProcessing", "Qwen3VLVideoProcessing", "SamplingRequest", "VideoMeta", "VideoPlan"]
