"""Test helpers: deterministic images and videos (and one crafted MP4), data URLs, a free port, a self-signed
certificate, a process's peak memory, and the rule for tests whose tool is missing."""

from __future__ import annotations

import base64
import datetime
import io
import os
import random
import socket
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

# Small limits for the end-to-end app, so that every limit can be hit cheaply.
LIMITS = {
    "max_request_bytes": 2 << 20,
    "max_image_pixels": 640 * 640,
    "max_images_per_request": 4,
    "default_max_tokens": 16,
}
DEMO_KEY = "sk-demo-test"  # the one API key of the session's demo app (tests/conftest.py: demo_app)


def make_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """Smooth gradients plus noise: varied enough that different images give different answers."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], -1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    return image.convert(mode) if mode != "RGB" else image


def make_video(
    seconds: float,
    fps: int = 8,
    width: int = 64,
    height: int = 48,
    seed: int = 0,
    fmt: str = "mp4",
    codec: str = "mpeg4",
) -> bytes:
    """A small video made with PyAV: each frame make_image's gradients and noise, a bar that moves, its own seed."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(round(seconds * fps)):
            pixels = np.asarray(make_image(width, height, seed=seed * 100_000 + i)).copy()
            pixels[:, (i * 3) % width : (i * 3) % width + 3] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def mp4_index_bomb(samples: int) -> bytes:
    """A 3 KB MP4 whose sample tables claim `samples` one-byte samples in one chunk: FFmpeg's MP4 demuxer builds an
    index entry (24 bytes) for each while it opens the file, before anything could look at what it read."""
    data = bytearray(make_video(1, fps=4, width=32, height=32))

    def atom(kind: bytes) -> int:  # where the table's size field starts (moov follows mdat: the last match)
        return bytes(data).rindex(kind) - 4

    struct.pack_into(">IIII", data, atom(b"stts") + 8, 0, 1, samples, 1)  # one run of `samples`, 1 tick each
    struct.pack_into(">IIIII", data, atom(b"stsc") + 8, 0, 1, 1, samples, 1)  # chunk 1 holds them all
    struct.pack_into(">III", data, atom(b"stsz") + 8, 0, 1, samples)  # each 1 byte: a constant size, no table
    return bytes(data)


def peak_rss(pid: int | None = None) -> int:
    """A process's peak resident memory in bytes (VmHWM; this process's by default), from /proc."""
    for line in Path(f"/proc/{pid or os.getpid()}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def video_frames(data: bytes) -> list[Image.Image]:
    """Every frame of a video, decoded by PyAV to RGB (what the server's decoder sees)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return [frame.to_image() for frame in container.decode(container.streams.video[0])]


def video_url(data: bytes, media_type: str = "video/mp4") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def data_url(image: Image.Image | bytes, fmt: str = "PNG") -> str:
    data = image if isinstance(image, bytes) else image_bytes(image, fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(data).decode()}"


# Ports handed to servers come from below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768 up):
# a port-0 bind or an outgoing connection (a Ray cluster starting makes hundreds) takes ports from that range, so a
# port found free there can be taken before the server binds it. That was seen in CI as an Ingress replica that
# could not bind the one port a test pinned for it. 20000-29999 also misses Ray's worker ports (10002-19999) and Serve's
# direct-ingress ranges (HTTP 30000-30999, gRPC 40000-40999).
SERVER_PORTS = range(20000, 30000)


def free_port() -> int:
    """A port nothing listens on, from SERVER_PORTS; random, so that test sessions running at once rarely pick the
    same one."""
    for port in random.sample(SERVER_PORTS, 500):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))  # also taken when something listens on 127.0.0.1 only
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {SERVER_PORTS}")


def leave_mid_stream(client, chunks: int = 4, max_tokens: int = 900) -> None:
    """Stream a long answer from `client` (an httpx.Client on the app) and go away after `chunks` lines."""
    body = {
        "messages": [{"role": "user", "content": "Talk for a long time."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for n, _ in enumerate(r.iter_lines()):
            if n >= chunks:
                break


def skip_or_fail(reason: str) -> None:
    """A test whose tool is missing skips on a developer's machine, and fails under `.ci/run`, which sets
    VLM_REQUIRE_ALL_TESTS=1 after installing every tool: CI never passes by skipping."""
    if os.environ.get("VLM_REQUIRE_ALL_TESTS") == "1":
        pytest.fail(f"{reason}; VLM_REQUIRE_ALL_TESTS=1 forbids skipping it")
    pytest.skip(reason)


def self_signed_certificate(host: str, directory: Path) -> tuple[str, str]:
    """(certificate, key) PEM paths of a self-signed P-256 certificate for `host`, made in-process."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)
