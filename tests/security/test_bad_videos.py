"""The bad-video battery through the deployed app: each video gets its 4xx with an OpenAI error body naming the part,
the app keeps serving, and the battery leaves the Encoder and Ingress replicas' memory bounded. All but the
half-decodable one are refused at the ingress, before any encoder work."""

from __future__ import annotations

import base64
import io
import struct
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from demo.inputs import image_bytes, make_image, make_video, video_url
from demo.local import replica_pids
from tests.helpers import mp4_index_bomb, peak_rss

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


def _claiming_12000x12000() -> bytes:
    """A 256x256 VP8 WebM whose track header (PixelWidth, PixelHeight) and keyframe header both say 12000x12000: a
    decompression bomb's shape (FFmpeg takes the size from the keyframe, so both are patched)."""
    out = bytearray(make_video(0.5, fps=4, width=256, height=256, fmt="webm", codec="libvpx"))
    for element in (b"\xb0\x82\x01\x00", b"\xba\x82\x01\x00"):  # EBML id, 2-byte size, 256
        at = out.index(element)
        out[at + 2 : at + 4] = (12000).to_bytes(2, "big")
    at = out.index(b"\x9d\x01\x2a")  # the VP8 keyframe start code, then width and height (14 bits each)
    out[at + 3 : at + 7] = struct.pack("<HH", 12000, 12000)
    return bytes(out)


def _a_million_frames() -> bytes:
    """An mp4 whose time-to-sample table claims 1,000,000 frames at about 964 fps (its 24 real frames follow)."""
    out = bytearray(VIDEO)
    at = out.index(b"stts")
    assert struct.unpack(">I", out[at + 8 : at + 12])[0] == 1  # one entry: (sample count, sample delta)
    out[at + 12 : at + 20] = struct.pack(">II", 1_000_000, 17)  # 17 ticks of 1/16384 s a frame
    return bytes(out)


CASES = {  # name -> (url, status, message fragment)
    "truncated_mp4": (video_url(VIDEO[: len(VIDEO) // 2]), 400, "video is not a readable container"),
    "zero_frames": (video_url(_encoded("mpeg4", 4, frames=0)), 400, "video data URL is empty"),
    "header_12000x12000": (video_url(_claiming_12000x12000(), "video/webm"), 400,
                           "video is 12000x12000, over the limit of 3840x2160"),
    "a_million_frames": (video_url(_a_million_frames()), 400, "video has 1000000 frames, over the limit of 100000"),
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


ROUNDS = 3  # the battery, sent this many times while memory is watched
# NOTE: well above what a warmed replica's allocators move by over the rounds, and below what a megabyte kept per
# refused video, or one transient buffer of half a claimed 12000x12000 frame, adds (both were seen to fail it).
MAX_GROWTH_MIB, MAX_PEAK_MIB = 16, 32


def _memory(app: str = "vlm", reset_peaks: bool = False) -> dict[str, tuple[int, int]]:
    """(resident, peak resident) bytes of the app's Encoder and Ingress replicas, by replica, from /proc;
    `reset_peaks`: each one's peak (VmHWM) first starts again from its resident memory now."""
    out = {}
    for name, pid in replica_pids(app).items():
        if name.startswith(("Encoder#", "Ingress#")):
            if reset_peaks:
                Path(f"/proc/{pid}/clear_refs").write_text("5")
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
            out[name] = (int(status["VmRSS"].split()[0]) << 10, int(status["VmHWM"].split()[0]) << 10)
    return out


def _battery(client) -> None:
    for url, status, _ in CASES.values():
        r = client.post("/v1/chat/completions", json=_body(url))
        assert r.status_code == status, r.text
    r = client.post("/v1/chat/completions", json=_body(video_url(_garbled(VIDEO))))  # the encoder's 400
    assert r.status_code == 400, r.text


def test_the_battery_leaves_encoder_and_ingress_memory_bounded(client):
    """Resident memory after the battery, and its peak during it, within a bound of where it was: a refused video
    leaves nothing behind in the Ingress or the Encoder and never costs its claimed size. (The decoding process has
    its own memory limit: tests/encoders/test_video_decode.py.)"""
    # Warm-up: a good video and one round load every path (PyAV in the ingress, decoding in the encoder).
    assert client.post("/v1/chat/completions", json=_body(video_url(VIDEO))).status_code == 200
    _battery(client)
    before = _memory(reset_peaks=True)
    assert any(n.startswith("Encoder#") for n in before) and any(n.startswith("Ingress#") for n in before), before
    for _ in range(ROUNDS):
        _battery(client)
    _serving(client)
    after = _memory()
    assert set(before) <= set(after), (before, after)  # no replica died or was replaced
    mib = {n: ((after[n][0] - before[n][0]) / 2**20, (after[n][1] - before[n][0]) / 2**20) for n in before}
    print(f"MiB grown (resident, peak) over {ROUNDS} rounds: {mib}")
    assert all(grown <= MAX_GROWTH_MIB and peak <= MAX_PEAK_MIB for grown, peak in mib.values()), mib
