"""Video bytes from requests: data: URLs (a container, or vLLM's list of JPEG frames) and the container probe that
reads duration, frame count, fps, size and codec with PyAV in a limited process of its own (video_worker.py),
demuxing packets, decoding no more than FFmpeg's stream probing does."""

from __future__ import annotations

import json
from dataclasses import dataclass

from encoders.images import decode_base64, probe_image
from encoders.video_decode import run_worker
from schemas import InvalidRequest, Limits, VideoArgs

# A data: URL's media type -> the container it must hold (the names of VideoArgs.containers).
MEDIA_TYPES = {"video/mp4": "mp4", "video/quicktime": "mp4", "video/webm": "webm", "video/x-matroska": "webm"}
# vLLM's frame list: data:video/jpeg;base64,<frame>,<frame>,...
FRAME_MEDIA_TYPES = {"video/jpeg": "JPEG"}
# FFmpeg's demuxer names -> ours: one demuxer reads MP4 and QuickTime, one WebM and Matroska.
_CONTAINERS = {"mov,mp4,m4a,3gp,3g2,mj2": "mp4", "matroska,webm": "webm"}


@dataclass(frozen=True, slots=True)
class VideoInfo:
    container: str
    codec: str
    width: int
    height: int
    num_frames: int
    fps: float
    duration_s: float


def _media_type(url: str) -> str:
    return url[5:].partition(",")[0].split(";", 1)[0].strip().lower()


def decode_video_data_url(url: str, max_bytes: int) -> tuple[str, bytes | list[bytes]]:
    """`data:video/mp4;base64,...` -> (the container it declares, its bytes); `data:video/jpeg;base64,f1,f2,...`
    -> ("frames", each frame's bytes). Anything else is the client's error."""
    if not url.startswith("data:"):
        raise InvalidRequest("video URL must be a data: URL here", code="image_url_not_allowed")
    header, sep, payload = url[5:].partition(",")
    media = _media_type(url)
    if not sep or not header.endswith(";base64"):
        raise InvalidRequest("video data URL must look like data:video/<type>;base64,<data>")
    if media in FRAME_MEDIA_TYPES:
        if len(payload) // 4 * 3 > max_bytes + 3 * (payload.count(",") + 1):
            raise InvalidRequest(
                f"video is about {len(payload) // 4 * 3} bytes, over the limit of {max_bytes}", status=413
            )
        frames = [decode_base64(part, max_bytes, "video frame") for part in payload.split(",")]
        return "frames", frames
    if media not in MEDIA_TYPES:
        raise InvalidRequest(
            f"video data URL declares media type {media[:64]!r}; use one of {sorted(MEDIA_TYPES | FRAME_MEDIA_TYPES)}"
        )
    return MEDIA_TYPES[media], decode_base64(payload, max_bytes, "video")


def probe_video(data: bytes, args: VideoArgs, limits: Limits, declared: str | None = None) -> VideoInfo:
    """The container's facts, checked against `args` (and the aspect-ratio limit), before any decoding; `declared`:
    the container a data: URL named. FFmpeg reads the untrusted bytes in a process of its own (video_worker.py),
    under `args.probe_timeout_s` and `args.probe_memory_mib`: a crash, a hang or a runaway allocation there is this
    request's 400, never the caller's."""
    if len(data) > args.max_video_bytes:  # the callers cut the bytes at this already: the probe's own bound
        raise InvalidRequest(f"video is {len(data)} bytes, over the limit of {args.max_video_bytes}", status=413)
    header = {"probe": True, "max_packets": args.max_source_frames, "memory_mib": args.probe_memory_mib}
    out = run_worker(header, data, args.probe_timeout_s, "probing", "video is not a readable container")
    facts = json.loads(out)
    name = _CONTAINERS.get(facts["format"])
    if name is None or name not in args.containers:
        raise InvalidRequest(f"video container {facts['format'][:64]!r} is not accepted; accepted: {args.containers}")
    if declared is not None and name != declared:
        raise InvalidRequest(f"video data URL declares a {declared} video, but its bytes are {name}")
    if (video := facts["video"]) is None:
        raise InvalidRequest("video has no video stream")
    info = _stream_info(video, facts["duration"], name, args, limits)
    num_frames = video["packets"]
    if num_frames == 0:
        raise InvalidRequest("video has no frames")
    if num_frames > args.max_source_frames:
        raise InvalidRequest(f"video has over {args.max_source_frames} frames, the limit")
    duration = max(info.duration_s, num_frames / info.fps)
    if duration > args.max_duration_s:
        raise InvalidRequest(f"video is {duration:.1f} s long, over the limit of {args.max_duration_s:g} s")
    return VideoInfo(info.container, info.codec, info.width, info.height, num_frames, info.fps, duration)


def _stream_info(video: dict, container_duration: int | None, name: str, args: VideoArgs, limits: Limits) -> VideoInfo:
    codec = video["codec"]
    if codec not in args.codecs:
        raise InvalidRequest(f"video codec {codec[:32]!r} is not accepted; accepted: {args.codecs}")
    width, height = video["width"], video["height"]
    if width < 1 or height < 1:
        raise InvalidRequest(f"video frames are {width}x{height}")
    if width > args.max_width or height > args.max_height:
        raise InvalidRequest(f"video is {width}x{height}, over the limit of {args.max_width}x{args.max_height}")
    ratio = max(width, height) / min(width, height)
    if ratio > limits.max_aspect_ratio:
        raise InvalidRequest(f"video aspect ratio {ratio:.1f} is over the limit of {limits.max_aspect_ratio:g}")
    fps = video["fps"]
    if not 0 < fps <= 1000:
        raise InvalidRequest(f"video frame rate {fps:g} is not usable (0 to 1000 frames per second)")
    if video["frames"] > args.max_source_frames:  # the header's count, when the container has one
        raise InvalidRequest(f"video has {video['frames']} frames, over the limit of {args.max_source_frames}")
    duration = video["duration_s"]
    if duration is None:
        duration = (container_duration or 0) / 1_000_000  # FFmpeg's AV_TIME_BASE
    if duration > args.max_duration_s:
        raise InvalidRequest(f"video is {duration:.1f} s long, over the limit of {args.max_duration_s:g} s")
    return VideoInfo(name, codec, width, height, 0, fps, max(duration, 0.0))


def probe_frames(frames: list[bytes], limits: Limits) -> tuple[int, int]:
    """(width, height) of a frame list, from the image headers; every frame must be an image of that size."""
    sizes = {(info.width, info.height) for info in (probe_image(f, limits) for f in frames)}
    if len(sizes) != 1:
        raise InvalidRequest(f"video frames must all have one size, got {sorted(sizes)[:4]}")
    return sizes.pop()


__all__ = ["FRAME_MEDIA_TYPES", "MEDIA_TYPES", "VideoInfo", "decode_video_data_url", "probe_frames", "probe_video"]
