"""Videos of a request, at the ingress: where they are, their URLs to fetch, the request's sampling settings
clamped to the server's, and each video's probe, plan and limits, before any decoding or encoder work."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from encoders.images import decode_data_url
from encoders.video_decode import Video
from encoders.video_processing import Qwen2VLVideoProcessing, SamplingRequest, VideoMeta, VideoPlan
from encoders.videos import decode_video_data_url, probe_frames, probe_video
from schemas import AppArgs, InvalidRequest
from schemas.openai import ChatCompletionRequest, VideoPart


def video_params(req: ChatCompletionRequest) -> list[tuple[int, str, VideoPart]]:
    """(message index, JSON path, part) of every video in the request, in order."""
    return [
        (i, f"messages[{i}].content[{j}]", part)
        for i, m in enumerate(req.messages)
        if isinstance(m.content, list)
        for j, part in enumerate(m.content)
        if isinstance(part, VideoPart)
    ]


def video_urls(req: ChatCompletionRequest) -> list[tuple[str, str]]:
    """(JSON path, url) of every video URL and frame URL, for the fetcher (which takes the http(s) and file ones)."""
    out = []
    for _, param, part in video_params(req):
        if part.video_url is not None:
            out.append((f"{param}.video_url", part.video_url.url))
        else:
            out += [(f"{param}.frames[{k}]", url) for k, url in enumerate(part.frames or [])]
    return out


def sampling_request(req: ChatCompletionRequest, processing: Qwen2VLVideoProcessing) -> SamplingRequest:
    """The request's mm_processor_kwargs, pixel bounds clamped to the checkpoint's (total_pixels is clamped to
    the server's where it is used)."""
    kw = req.mm_processor_kwargs
    if kw is None:
        return SamplingRequest()

    def clamp(v: int | None) -> int | None:
        return None if v is None else max(processing.patch_size**2, min(v, processing.max_pixels))

    return SamplingRequest(kw.fps, kw.nframes, clamp(kw.min_pixels), clamp(kw.max_pixels), kw.total_pixels)


@dataclass(slots=True, frozen=True)
class PreparedVideo:
    video: Video
    key: str  # embedding and prefix cache key: content, sampling, preprocessing, model
    size: tuple[int, int]  # the source's (width, height)
    chunks: list[tuple[Video, str]]  # the encoder calls: tubelet chunks, each with its embedding cache key
    probe_s: float = 0.0  # seconds to read the container (0 for a frame list)


class VideoPreparer:
    def __init__(self, args: AppArgs, processing: Qwen2VLVideoProcessing | None, model_id: str, model_name: str):
        self.args, self.video, self.processing = args, args.video, processing
        self.model_id, self.model_name = model_id, model_name
        # A video over encoder.max_batch_patches goes to the encoder tier in chunks of tubelets, concurrently (one
        # call each, so several replicas share it); colocated, the LLM replica encodes it whole.
        self.max_chunk_patches = None if args.encoder.colocated else args.encoder.max_batch_patches

    def check(self, req: ChatCompletionRequest) -> None:
        """Before anything is fetched: the model takes video, and not too many."""
        params = video_params(req)
        if params and self.processing is None:
            raise InvalidRequest(f"model {self.model_name!r} does not take video input", param=params[0][1])
        if len(params) > self.video.max_videos_per_request:
            raise InvalidRequest(
                f"{len(params)} videos in one request, over the limit of {self.video.max_videos_per_request}",
                param=params[self.video.max_videos_per_request][1],
            )

    def prepare(self, param: str, part: VideoPart, req: ChatCompletionRequest, fetched: dict[str, bytes]):
        """One video's probe, plan and limits; every error names `param`."""
        try:
            return self._prepare(param, part, req, fetched)
        except InvalidRequest as e:
            raise InvalidRequest(f"{param}: {e.message}", param=param, code=e.code, status=e.status) from e

    def _prepare(self, param: str, part: VideoPart, req: ChatCompletionRequest, fetched: dict[str, bytes]):
        assert self.processing is not None
        limits, sampling = self.args.limits, sampling_request(req, self.processing)
        if part.frames is not None:  # {"video": [frame URLs]}
            frames = [
                fetched.get(f"{param}.frames[{k}]") or decode_data_url(url, limits.max_image_bytes)
                for k, url in enumerate(part.frames)
            ]
            data, kind = frames, "frames"
        else:
            url = part.video_url.url
            if f"{param}.video_url" in fetched:
                data, kind = fetched[f"{param}.video_url"], None
            else:
                kind, data = decode_video_data_url(url, self.video.max_video_bytes)
        if isinstance(data, list):
            if (total := sum(map(len, data))) > (cap := self.video.max_video_bytes):
                raise InvalidRequest(f"video is {total} bytes, over the limit of {cap}", status=413)
            width, height = probe_frames(data, limits)
            meta = VideoMeta(len(data), sampling.fps or self.processing.fps, width, height)
            plan = self.processing.frame_list_plan(meta, sampling, self.video.total_pixels)
            digest = hashlib.sha256(b"".join(hashlib.sha256(f).digest() for f in data)).hexdigest()
            probe_s = 0.0
        else:
            started = time.monotonic()
            info = probe_video(data, self.video, limits, kind)
            probe_s = time.monotonic() - started
            meta = VideoMeta(info.num_frames, info.fps, info.width, info.height)
            plan = self.processing.plan(meta, sampling, self.video.total_pixels)
            digest = hashlib.sha256(data).hexdigest()
        self._check(plan)
        key = f"video:{digest}:{_plan_key(plan)}:{self.processing.fingerprint()}:{self.model_id}"
        ranges = plan.chunks(self.max_chunk_patches) if self.max_chunk_patches else [(0, plan.grid_thw[0])]
        whole = len(ranges) == 1
        chunks = [
            (Video(data, plan if whole else plan.chunk(a, b)), key if whole else f"{key}@{a}-{b}") for a, b in ranges
        ]
        return PreparedVideo(Video(data, plan), key, (meta.width, meta.height), chunks, probe_s)

    def _check(self, plan: VideoPlan) -> None:
        if len(plan.indices) > self.video.max_frames:
            raise InvalidRequest(
                f"video sampling gives {len(plan.indices)} frames, over the limit of {self.video.max_frames} "
                "(lower mm_processor_kwargs.fps or nframes)"
            )
        if plan.num_tokens > self.video.max_video_tokens:
            raise InvalidRequest(
                f"video takes {plan.num_tokens} tokens, over the limit of {self.video.max_video_tokens} "
                "(lower mm_processor_kwargs.fps, nframes or max_pixels)"
            )


def _plan_key(plan: VideoPlan) -> str:
    """The sampling in the cache key: the same bytes sampled otherwise are another embedding."""
    what = f"{plan.indices}|{plan.width}x{plan.height}|{plan.sample_fps!r}"
    return hashlib.sha256(what.encode()).hexdigest()[:16]


__all__ = ["PreparedVideo", "VideoPreparer", "sampling_request", "video_params", "video_urls"]
