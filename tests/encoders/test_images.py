"""Image input: data URLs, header-only checks against the limits, decoding."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from demo.inputs import data_url, image_bytes, make_image
from encoders import data_url_format, decode_data_url, load_rgb, probe_image
from schemas import InvalidRequest, Limits


def test_data_url_round_trip():
    png = image_bytes(make_image(20, 10))
    assert decode_data_url(data_url(png), max_bytes=1 << 20) == png


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("http://example.com/cat.png", "is not accepted"),
        ("file:///etc/passwd", "is not accepted"),
        ("cat.png", "is not accepted"),
        ("data:image/png,abc", "base64"),
        ("data:image/png;base64,@@@notbase64", "not valid base64"),
        ("data:image/png;base64,", "empty"),
    ],
)
def test_bad_data_urls_are_client_errors(url, fragment):
    with pytest.raises(InvalidRequest, match=fragment):
        decode_data_url(url, max_bytes=1 << 20)


def test_image_bytes_limit_is_checked_before_decoding():
    url = "data:image/png;base64," + base64.b64encode(b"x" * 5000).decode()
    with pytest.raises(InvalidRequest, match="over the limit of 1000") as e:
        decode_data_url(url, max_bytes=1000)
    assert e.value.status == 413


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_probe_reads_format_and_size(fmt):
    info = probe_image(image_bytes(make_image(33, 21), fmt), Limits())
    assert (info.format, info.width, info.height) == (fmt, 33, 21)


def test_probe_rejects_non_images_and_limits():
    with pytest.raises(InvalidRequest, match="not a decodable image"):
        probe_image(b"this is not an image at all", Limits())
    with pytest.raises(InvalidRequest, match="over the limit of 100"):
        probe_image(image_bytes(make_image(11, 10)), Limits(max_image_pixels=100))
    with pytest.raises(InvalidRequest, match="aspect ratio"):
        probe_image(image_bytes(make_image(300, 1)), Limits())
    with pytest.raises(InvalidRequest, match="format TIFF"):
        probe_image(image_bytes(make_image(8, 8), "TIFF"), Limits())


def test_truncated_pixels_fail_on_decode_not_on_probe():
    png = image_bytes(make_image(64, 64))
    truncated = png[: len(png) // 2]
    assert probe_image(truncated, Limits()).width == 64  # the header is intact
    with pytest.raises(InvalidRequest, match="could not be decoded"):
        load_rgb(truncated)


def test_modes_become_rgb():
    for mode in ("L", "P", "RGBA", "CMYK"):
        image = make_image(12, 9, mode=mode)
        fmt = "JPEG" if mode == "CMYK" else "PNG"
        assert load_rgb(image_bytes(image, fmt)).mode == "RGB"


PNG = image_bytes(make_image(20, 10))


@pytest.mark.parametrize(
    "media", ["text/html", "application/octet-stream", "image/svg+xml", "image/tiff", "", "image", "text/plain;a=b"]
)
def test_a_data_url_must_declare_an_image_type(media):
    """data:text/html;base64,<png bytes> is refused: the declared type is an allowed image type, or nothing."""
    url = f"data:{media};base64," + base64.b64encode(PNG).decode()
    with pytest.raises(InvalidRequest, match="not an image type") as e:
        decode_data_url(url, max_bytes=1 << 20)
    assert e.value.status == 400


@pytest.mark.parametrize(
    ("media", "fmt"), [("IMAGE/PNG", "PNG"), ("image/jpg", "JPEG"), ("image/x-ms-bmp", "BMP"), ("image/webp ", "WEBP")]
)
def test_declared_types_are_read_case_blind_with_aliases(media, fmt):
    url = f"data:{media};name=x;base64," + base64.b64encode(image_bytes(make_image(20, 10), fmt)).decode()
    assert data_url_format(url) == fmt
    assert probe_image(decode_data_url(url, max_bytes=1 << 20), Limits(), data_url_format(url)).format == fmt


@pytest.mark.parametrize(("declared", "actual"), [("JPEG", "PNG"), ("PNG", "GIF"), ("GIF", "WEBP")])
def test_the_bytes_must_be_the_declared_format(declared, actual):
    data = image_bytes(make_image(20, 10), actual)
    assert probe_image(data, Limits()).format == actual  # no declaration (a fetched image): any accepted format
    with pytest.raises(InvalidRequest, match=f"declares a {declared} image, but its bytes are {actual}"):
        probe_image(data, Limits(), declared)


def test_a_phone_camera_mpo_jpeg_is_a_jpeg():
    """Many phone photos are MPO files (a JPEG followed by more frames); they are JPEGs to a client, and to us."""
    first, second = Image.new("RGB", (40, 30), (200, 30, 30)), Image.new("RGB", (40, 30), (30, 30, 200))
    buf = io.BytesIO()
    first.save(buf, format="MPO", save_all=True, append_images=[second])
    data = buf.getvalue()
    assert Image.open(io.BytesIO(data)).format == "MPO"
    info = probe_image(data, Limits(), declared=data_url_format("data:image/jpeg;base64,"))
    assert (info.format, info.width, info.height) == ("JPEG", 40, 30)
    image = load_rgb(data, draft_size=(20, 15))
    pixels = image.getpixel((image.width // 2, image.height // 2))
    assert pixels[0] > 150 and pixels[2] < 100  # the first frame's red, decoded
