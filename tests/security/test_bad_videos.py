"""The bad-video battery through the deployed app: each video gets its 4xx with an OpenAI error body naming the part,
and the app keeps serving. All but the half-decodable one are refused at the ingress, before any encoder work."""

from __future__ import annotations

import base64
import io
from fractions import Fraction

import av
import numpy as np
import pytest

from bench.soak_probe import replica_pids
from tests.helpers import image_bytes, make_image, make_video, mp4_index_bomb, peak_rss, video_url

pytestmark = pytest.mark.e2e
PART = "messages[0].content[0]"
VIDEO = make_video(3, fps=8, width=64, height=48, codec="libx264")


def _encoded(codec: str, rate, frames: int = 4, pix_fmt: str = "yuv420p") -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = 64, 48, pix_fmt
        for k in range(frames):
            frame = av.VideoFrame.from_ndarray(np.asarray(make_image(64, 48, seed=k)), format="rgb24")
            frame.pts = k
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _garbled(data: bytes) -> bytes:
    """The second half of the frames' data overwritten: the container reads, frame 10 or so does not decode."""
    at = data.find(b"mdat")
    size = int.from_bytes(data[at - 4 : at], "big")
    out = bytearray(data)
    a, b = at + 4 + size // 2, at + 4 + size * 95 // 100
    out[a:b] = (bytes(range(256)) * ((b - a) // 256 + 1))[: b - a]
    return bytes(out)


CASES = {  # name -> (url, status, message fragment)
    "truncated_mp4": (video_url(VIDEO[: len(VIDEO) // 2]), 400, "video is not a readable container"),
    "zero_frames": (video_url(_encoded("mpeg4", 4, frames=0)), 400, "video data URL is empty"),
    "ten_hours": (video_url(_encoded("mpeg4", Fraction(1, 3600), frames=10)), 400,
                  "video is 36000.0 s long, over the limit of 600 s"),
    "unknown_codec": (video_url(_encoded("mjpeg", 4, pix_fmt="yuvj420p")), 400, "video codec 'mjpeg' is not accepted"),
    "an_image_as_mp4": (video_url(image_bytes(make_image(64, 64))), 400, "video container 'png_pipe' is not accepted"),
    "polyglot_png_then_mp4": (video_url(image_bytes(make_image(8, 8)) + VIDEO), 400, "is not accepted"),
    "mp4_declared_webm": (video_url(VIDEO, "video/webm"), 400, "declares a webm video, but its bytes are mp4"),
    "not_a_video_type": (video_url(VIDEO, "video/x-msvideo"), 400, "declares media type 'video/x-msvideo'"),
    "not_base64": ("data:video/mp4;base64,@@@@", 400, "not valid base64"),
}  # fmt: skip


def _body(url: str, **fields) -> dict:
    part = {"type": "video_url", "video_url": {"url": url}}
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}], "max_tokens": 2, **fields}


def _serving(client) -> None:
    ok = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("case", list(CASES))
def test_bad_video_is_a_clear_error(case, client):
    url, status, fragment = CASES[case]
    r = client.post("/v1/chat/completions", json=_body(url))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith(PART), error
    assert fragment in error["message"], error
    _serving(client)


def test_a_half_decodable_video_is_a_400_from_its_encoder_and_the_encoder_goes_on(client):
    r = client.post("/v1/chat/completions", json=_body(video_url(_garbled(VIDEO))))
    assert r.status_code == 400, r.text
    assert "video could not be decoded: frame" in r.json()["error"]["message"], r.text
    assert client.post("/v1/chat/completions", json=_body(video_url(VIDEO))).status_code == 200
    _serving(client)


def test_a_crafted_container_costs_the_ingress_nothing(client):
    """A 3 KB MP4 whose tables claim 40 million samples: FFmpeg builds their index while it opens the file, gigabytes
    in whichever process probes it. That is the probe's own process, under its memory limit: a 400 at once, and the
    ingress's peak memory does not move (red with the probe in the ingress's process)."""
    [pid] = [pid for name, pid in replica_pids("vlm").items() if name.startswith("Ingress#")]
    before = peak_rss(pid)
    r = client.post("/v1/chat/completions", json=_body(video_url(mp4_index_bomb(40_000_000))))
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(PART), r.text
    assert peak_rss(pid) - before < 256 << 20, (peak_rss(pid) - before) >> 20
    _serving(client)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [({"fps": 1, "nframes": 4}, "give fps or nframes, not both"),
     ({"nframes": 100}, "video sampling gives 100 frames; it must be 2 to the video's 24 frames")],
)  # fmt: skip
def test_bad_sampling_settings(kwargs, fragment, client):
    r = client.post("/v1/chat/completions", json=_body(video_url(VIDEO), mm_processor_kwargs=kwargs))
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text


def test_frames_of_a_frame_list_must_be_images(client):
    url = "data:video/jpeg;base64," + ",".join([base64.b64encode(b"not a jpeg").decode()] * 2)
    r = client.post("/v1/chat/completions", json=_body(url))
    assert r.status_code == 400 and "not a decodable image" in r.json()["error"]["message"], r.text
