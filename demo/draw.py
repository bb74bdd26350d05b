"""Draw an answer's grounding boxes (the response's `boxes`, in pixels) on the image they refer to."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from PIL import Image, ImageDraw

COLOURS = ("#ff2d55", "#00c7be", "#ffcc00", "#5856d6", "#34c759")


def _field(box: Any, name: str) -> Any:
    return box[name] if isinstance(box, Mapping) else getattr(box, name)


def draw_boxes(image: Image.Image, boxes: Iterable[Any], width: int = 2) -> Image.Image:
    """A copy of `image` with each box outlined and labelled; boxes are dicts or objects with label, x1..y2."""
    out = image.convert("RGB")
    draw = ImageDraw.Draw(out)
    for i, box in enumerate(boxes):
        colour = COLOURS[i % len(COLOURS)]
        x1, y1, x2, y2 = (int(_field(box, k)) for k in ("x1", "y1", "x2", "y2"))
        draw.rectangle((x1, y1, x2, y2), outline=colour, width=width)
        if label := _field(box, "label"):
            left, top, right, bottom = draw.textbbox((x1, y1), label)
            y = y1 - (bottom - top) - 4 if y1 - (bottom - top) - 4 >= 0 else y2 + 2
            draw.rectangle((x1, y, x1 + right - left + 4, y + bottom - top + 4), fill=colour)
            draw.text((x1 + 2, y + 1), label, fill="black")
    return out


__all__ = ["draw_boxes"]
