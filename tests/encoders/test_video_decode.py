"""Video decoding in its own process: the sampled frames equal PyAV's own decode of them resized, and a video that
cannot be decoded (broken, half-decodable, too slow, too big for the memory limit) is a 400, never a crash here."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from demo.inputs import make_video
from encoders import video_decode
from encoders.video_decode import Video, decode_video
from encoders.video_processing import Qwen2VLVideoProcessing, SamplingRequest, VideoMeta
from encoders.videos import probe_video
from schemas import InvalidRequest, Limits, VideoArgs
from tests.helpers import video_frames

ARGS = VideoArgs()


def _plan(data: bytes, **kw):
    frames = video_frames(data)
    meta = VideoMeta(len(frames), 8.0, frames[0].width, frames[0].height)
    return Qwen2VLVideoProcessing().plan(meta, SamplingRequest(**kw), ARGS.total_pixels)


@pytest.mark.parametrize("fmt,codec", [("mp4", "mpeg4"), ("mp4", "libx264"), ("webm", "libvpx")])
def test_sampled_frames_equal_pyav_decoding_resized(fmt, codec):
    data = make_video(3, fps=8, width=64, height=48, fmt=fmt, codec=codec)
    plan = _plan(data)
    assert len(plan.indices) == 6 and plan.indices[-1] == 23
    frames = Video(data, plan).decode(ARGS.decode_timeout_s, ARGS.decode_memory_mib)
    source = video_frames(data)
    expected = [np.asarray(source[i].resize((plan.width, plan.height), Image.Resampling.BICUBIC)) for i in plan.indices]
    assert frames.shape == (6, plan.height, plan.width, 3)
    np.testing.assert_array_equal(frames, np.stack(expected))


def test_a_half_decodable_video_is_a_400_not_a_shorter_video():
    data = make_video(3, fps=8)
    plan = _plan(data)
    with pytest.raises(InvalidRequest, match="could not be decoded") as e:
        decode_video(data[: len(data) * 2 // 3], plan, 30, ARGS.decode_memory_mib)
    assert e.value.status == 400
    with pytest.raises(InvalidRequest, match="could not be decoded"):
        decode_video(b"\x00" * 5000, plan, 30, ARGS.decode_memory_mib)


def test_a_crash_of_the_video_process_is_that_requests_400(tmp_path, monkeypatch):
    """FFmpeg crashing on a crafted file (a long CVE list) kills the probing or decoding process, not the caller."""
    crash = tmp_path / "crash.py"
    crash.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    monkeypatch.setattr(video_decode, "WORKER", crash)
    with pytest.raises(InvalidRequest, match="not a readable container: the probing process was killed by SIGSEGV"):
        probe_video(make_video(1), ARGS, Limits())
    data = make_video(1)
    with pytest.raises(InvalidRequest, match="could not be decoded: the decoding process was killed by SIGSEGV"):
        decode_video(data, _plan(data), 30, ARGS.decode_memory_mib)


def test_the_limits_end_the_decoder_not_the_caller():
    data = make_video(1, fps=4, width=1920, height=1088)
    plan = Qwen2VLVideoProcessing().plan(VideoMeta(4, 4.0, 1920, 1088), SamplingRequest(), ARGS.total_pixels)
    with pytest.raises(InvalidRequest, match="video decoding took over the limit of 0.01 s"):
        decode_video(data, plan, 0.01, ARGS.decode_memory_mib)
    # NOTE: measured: the worker with ffmpeg loaded fits in 160 MiB of address space, a 1920x1088 frame does not
    with pytest.raises(InvalidRequest, match="frame 0 could not be decoded \\(MemoryError\\)"):
        decode_video(data, plan, 30, 160)
    assert decode_video(data, plan, 30, ARGS.decode_memory_mib).shape[0] == len(plan.indices)  # and it goes on
