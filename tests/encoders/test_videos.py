"""The ingress's video probe (PyAV, container metadata and packets, no pixels, in a limited process of its own) and
data: URLs, with their 4xx."""

from __future__ import annotations

import base64

import pytest

from demo.inputs import image_bytes, make_image, make_video, video_url
from encoders.videos import decode_video_data_url, probe_frames, probe_video
from schemas import InvalidRequest, Limits, VideoArgs
from tests.helpers import mp4_index_bomb, peak_rss


@pytest.mark.parametrize(
    "fmt,codec,container,codec_name", [("mp4", "mpeg4", "mp4", "mpeg4"), ("mp4", "libx264", "mp4", "h264"),
                                       ("webm", "libvpx", "webm", "vp8"),
                                       ("mp4", "libsvtav1", "mp4", "av1")]  # decoded by libdav1d: named av1
)  # fmt: skip
def test_probe_reads_the_container(fmt, codec, container, codec_name):
    info = probe_video(make_video(2.5, fps=8, width=64, height=48, fmt=fmt, codec=codec), VideoArgs(), Limits())
    assert (info.container, info.codec, info.width, info.height) == (container, codec_name, 64, 48)
    assert (info.num_frames, info.fps, info.duration_s) == (20, 8.0, pytest.approx(2.5))


@pytest.mark.parametrize(
    "args,message",
    [
        (VideoArgs(containers=["webm"]), "video container 'mov,mp4,m4a,3gp,3g2,mj2' is not accepted"),
        (VideoArgs(codecs=["h264"]), "video codec 'mpeg4' is not accepted"),
        (VideoArgs(max_width=63), "video is 64x48, over the limit of 63x2160"),
        (VideoArgs(max_height=47), "video is 64x48, over the limit of 3840x47"),
        (VideoArgs(max_duration_s=2.0), "video is 2.5 s long, over the limit of 2 s"),
        (VideoArgs(max_source_frames=19), "video has 20 frames, over the limit of 19"),
    ],
)
def test_probe_limits_name_the_number_and_the_limit(args, message):
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace(")", r"\)")):
        probe_video(make_video(2.5, fps=8, width=64, height=48), args, Limits())


def test_probe_refuses_what_is_not_a_video():
    video = make_video(2.5)
    with pytest.raises(InvalidRequest, match="aspect ratio 4.0 is over the limit of 3"):
        probe_video(make_video(1, width=128, height=32), VideoArgs(), Limits(max_aspect_ratio=3))
    with pytest.raises(InvalidRequest, match="video is not a readable container"):
        probe_video(b"\x00" * 1000, VideoArgs(), Limits())
    with pytest.raises(InvalidRequest, match="video container 'png_pipe' is not accepted"):
        probe_video(image_bytes(make_image(32, 32)), VideoArgs(), Limits())
    with pytest.raises(InvalidRequest, match="declares a webm video, but its bytes are mp4"):
        probe_video(video, VideoArgs(), Limits(), declared="webm")


def test_a_crafted_container_costs_the_caller_nothing():
    """An MP4 whose tables claim 40 million samples: opening it builds their index, gigabytes and seconds of work.
    In the probe's own process the memory limit stops it at once (a 400) and the caller's memory does not grow;
    with the memory limit loosened, the time limit ends it. Red with the probe in the caller's process."""
    before = peak_rss()
    with pytest.raises(InvalidRequest) as e:
        probe_video(mp4_index_bomb(40_000_000), VideoArgs(), Limits())
    assert e.value.status == 400 and peak_rss() - before < 256 << 20, (e.value.message, peak_rss() - before)
    with pytest.raises(InvalidRequest, match="video probing took over the limit of 1 s"):
        probe_video(mp4_index_bomb(89_000_000), VideoArgs(probe_memory_mib=4096, probe_timeout_s=1), Limits())
    assert probe_video(make_video(1), VideoArgs(), Limits()).num_frames == 8  # and the next one is read


def test_data_urls():
    video = make_video(1)
    assert decode_video_data_url(video_url(video), 1 << 20) == ("mp4", video)
    assert decode_video_data_url(video_url(video, "video/quicktime"), 1 << 20) == ("mp4", video)
    with pytest.raises(InvalidRequest, match="over the limit of 100") as e:
        decode_video_data_url(video_url(video), 100)
    assert e.value.status == 413
    with pytest.raises(InvalidRequest, match="declares media type 'video/avi'"):
        decode_video_data_url(video_url(video, "video/avi"), 1 << 20)
    frames = [image_bytes(make_image(40, 30, seed=s), "JPEG") for s in range(3)]
    url = "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)
    assert decode_video_data_url(url, 1 << 20) == ("frames", frames)
    assert probe_frames(frames, Limits()) == (40, 30)
    with pytest.raises(InvalidRequest, match=r"video frames must all have one size, got \[\(30, 40\), \(40, 30\)\]"):
        probe_frames([*frames, image_bytes(make_image(30, 40), "JPEG")], Limits())
