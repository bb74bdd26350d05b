"""The drawing helper puts each box where its pixels say, on a copy of the image."""

from __future__ import annotations

from PIL import Image

from demo.draw import draw_boxes


def test_boxes_are_drawn_where_they_say():
    image = Image.new("RGB", (120, 80), "white")
    out = draw_boxes(image, [{"label": "the red circle", "x1": 30, "y1": 30, "x2": 90, "y2": 70}])
    assert image.getpixel((30, 50)) == (255, 255, 255)  # the original is untouched
    assert out.getpixel((30, 50)) != (255, 255, 255) and out.getpixel((90, 50)) != (255, 255, 255)  # both sides
    assert out.getpixel((60, 50)) == (255, 255, 255)  # inside stays clear
    assert out.getpixel((10, 5)) == (255, 255, 255)  # far outside too
