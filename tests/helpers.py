"""Test helpers: one crafted MP4, a video's frames, a self-signed certificate, a process's peak memory, a client that
leaves mid-stream, and the rule for tests whose tool is missing. (Images, videos and data: URLs are demo/inputs.py's;
free ports, the small limits and the local app's processes demo/local.py's: the benchmarks share them.)"""

from __future__ import annotations

import datetime
import io
import os
import struct
from pathlib import Path

import pytest
from PIL import Image

from demo.inputs import make_video

DEMO_KEY = "sk-demo-test"  # the one API key of the session's demo app (tests/conftest.py: demo_app)


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
