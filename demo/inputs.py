"""Made-up inputs for the served app, deterministic from a seed: images (gradients and noise, varied enough that
different images give different answers), small videos made with PyAV, and the data: URLs a request carries them in.
Shared by the tests, the benchmarks and anyone poking a local server."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


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


def video_url(data: bytes, media_type: str = "video/mp4") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def data_url(image: Image.Image | bytes, fmt: str = "PNG") -> str:
    data = image if isinstance(image, bytes) else image_bytes(image, fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(data).decode()}"


__all__ = ["data_url", "image_bytes", "make_image", "make_video", "video_url"]
