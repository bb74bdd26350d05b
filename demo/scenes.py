"""Deterministic synthetic scenes (1 to 3 coloured shapes on a background) with questions and exact answers."""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 70), "blue": (40, 90, 230), "yellow": (240, 210, 40),
    "purple": (150, 60, 190), "orange": (245, 140, 30), "white": (250, 250, 250), "black": (15, 15, 15),
}  # fmt: skip
# Background base colour -> shape colours it would clash with (too close to see the shape).
BACKGROUNDS: dict[tuple[int, int, int], frozenset[str]] = {
    (205, 205, 205): frozenset({"white"}),
    (125, 125, 125): frozenset(),
    (55, 55, 60): frozenset({"black"}),
    (215, 200, 160): frozenset({"white", "yellow"}),
    (30, 40, 80): frozenset({"black", "blue"}),
}
KINDS: tuple[str, ...] = ("colour", "shape", "count", "grounding", "which_image")
MIN_SIDE, MAX_SIDE = 112, 336  # image width and height, px, drawn independently
_SUPERSAMPLE = 4  # shapes are drawn 4x larger and averaged down: smooth edges where the box says

# NOTE: the background is a soft lighting gradient (brighter to the right, warmer to the bottom), not a flat
# colour. Qwen2-VL's ViT has only 2-D RoPE, which is relative: on a flat background a shape looks the same
# wherever it is, and the absolute (0..1000) coordinates of a grounding answer are nearly invisible to a
# model this small. The gradient makes "where in the picture" a property of the pixels.
_GRADIENT_X = (25, 25, 25)  # added at the right edge, subtracted at the left
_GRADIENT_Y = (18, 0, -18)  # added at the bottom, subtracted at the top


@dataclass(slots=True, frozen=True)
class Shape:
    colour: str
    shape: str
    box: tuple[int, int, int, int]  # x1, y1, x2, y2 in pixels of the image (x2, y2: the far edges)

    @property
    def label(self) -> str:
        return f"the {self.colour} {self.shape}"


@dataclass(slots=True)
class Scene:
    image: Image.Image
    objects: list[Shape]

    def normalized_box(self, obj: Shape) -> tuple[int, int, int, int]:
        """Qwen2-VL's convention: 0..1000 integers of the original image size."""
        w, h = self.image.size
        x1, y1, x2, y2 = obj.box
        return (round(x1 / w * 1000), round(y1 / h * 1000), round(x2 / w * 1000), round(y2 / h * 1000))

    def questions(self) -> list[tuple[str, str, str, Shape | None]]:
        """Every (kind, question, answer, object) this scene answers exactly, in a fixed order."""
        out: list[tuple[str, str, str, Shape | None]] = []
        shapes = [o.shape for o in self.objects]
        colours = [o.colour for o in self.objects]
        for o in self.objects:
            if shapes.count(o.shape) == 1:
                out.append(("colour", f"What colour is the {o.shape}?", o.colour, o))
        for o in self.objects:
            if colours.count(o.colour) == 1:
                for noun in ("one", "object"):
                    out.append(("shape", f"What shape is the {o.colour} {noun}?", o.shape, o))
        out.append(("count", "How many shapes are there?", str(len(self.objects)), None))
        for o in self.objects:
            x1, y1, x2, y2 = self.normalized_box(o)
            answer = (f"<|object_ref_start|>{o.label}<|object_ref_end|>"
                      f"<|box_start|>({x1},{y1}),({x2},{y2})<|box_end|>")  # fmt: skip
            out.append(("grounding", f"Where is the {o.colour} {o.shape}?", answer, o))
        return out


def _star(n_points: int = 5, inner: float = 0.45) -> list[tuple[float, float]]:
    """A star's vertices scaled to fill the unit square exactly (its bounding box is [0, 1]^2)."""
    pts = []
    for k in range(2 * n_points):
        r = 1.0 if k % 2 == 0 else inner
        a = -math.pi / 2 + k * math.pi / n_points
        pts.append((r * math.cos(a), r * math.sin(a)))
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    return [((x - min(xs)) / (max(xs) - min(xs)), (y - min(ys)) / (max(ys) - min(ys))) for x, y in pts]


_UNIT = {
    "square": [(0.0, 0.0), (1.0, 0.0), (1.0, 1.0), (0.0, 1.0)],
    "triangle": [(0.5, 0.0), (1.0, 1.0), (0.0, 1.0)],
    "star": _star(),
}


def _mask(obj: Shape) -> Image.Image:
    """The shape's anti-aliased coverage (0..255) over its box, drawn 4x larger and averaged down."""
    x1, y1, x2, y2 = obj.box
    w, h = x2 - x1, y2 - y1
    ss = _SUPERSAMPLE
    mask = Image.new("L", (w * ss, h * ss), 0)
    draw = ImageDraw.Draw(mask)
    if obj.shape == "circle":
        draw.ellipse((0, 0, w * ss - 1, h * ss - 1), fill=255)
    else:
        draw.polygon([(u * (w * ss - 1), v * (h * ss - 1)) for u, v in _UNIT[obj.shape]], fill=255)
    return mask.resize((w, h), Image.Resampling.BOX)


def _draw_shape(image: Image.Image, obj: Shape) -> None:
    """Paste one anti-aliased shape that fills obj.box exactly."""
    image.paste(COLOURS[obj.colour], obj.box, _mask(obj))


def coverage(obj: Shape, size: tuple[int, int]) -> np.ndarray:
    """(height, width) float32 in 0..1: how much of each pixel of a size=(width, height) picture the shape covers."""
    out = np.zeros((size[1], size[0]), dtype=np.float32)
    x1, y1, x2, y2 = obj.box
    out[y1:y2, x1:x2] = np.asarray(_mask(obj), dtype=np.float32) / 255
    return out


def _background(rng: random.Random, width: int, height: int) -> tuple[Image.Image, frozenset[str]]:
    base, clashes = rng.choice(list(BACKGROUNDS.items()))
    # Separable: one row and one column of offsets, broadcast; int16 keeps the sum exact and cheap.
    x = (np.arange(width) + 0.5) / width * 2 - 1  # (W,) -1 at the left edge, +1 at the right
    y = (np.arange(height) + 0.5) / height * 2 - 1  # (H,)
    row = np.rint(x[:, None] * _GRADIENT_X).astype(np.int16) + np.array(base, dtype=np.int16)  # (W, 3)
    col = np.rint(y[:, None] * _GRADIENT_Y).astype(np.int16)  # (H, 3)
    pixels = row[None, :, :] + col[:, None, :]  # (H, W, 3)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB"), clashes


def make_scene(rng: random.Random, num_objects: int | None = None,
               size: tuple[int, int] | None = None) -> Scene:  # fmt: skip
    """One scene from rng: a background and 1 to 3 non-overlapping shapes, no two alike in both colour and shape."""
    width, height = size or (rng.randint(MIN_SIDE, MAX_SIDE), rng.randint(MIN_SIDE, MAX_SIDE))
    image, clashes = _background(rng, width, height)
    palette = [c for c in COLOURS if c not in clashes]
    n = num_objects or rng.randint(1, 3)
    short = min(width, height)
    gap = max(3, round(0.04 * short))
    while True:  # re-draw all the shapes when the last one does not fit (rare, small images with 3 shapes)
        objects: list[Shape] = []
        for _ in range(n):
            for _attempt in range(50):
                s = rng.randint(round(0.22 * short), round(0.42 * short))
                x1, y1 = rng.randint(2, width - s - 2), rng.randint(2, height - s - 2)
                box = (x1, y1, x1 + s, y1 + s)
                if all(box[0] >= o.box[2] + gap or o.box[0] >= box[2] + gap or
                       box[1] >= o.box[3] + gap or o.box[1] >= box[3] + gap for o in objects):  # fmt: skip
                    break
            else:
                break
            while True:
                colour, shape = rng.choice(palette), rng.choice(SHAPES)
                if all((o.colour, o.shape) != (colour, shape) for o in objects):
                    break
            objects.append(Shape(colour, shape, box))
        if len(objects) == n:
            break
    for obj in objects:
        _draw_shape(image, obj)
    return Scene(image, objects)


def pair_questions(first: Scene, second: Scene) -> list[tuple[str, str, int]]:
    """Questions about two pictures: (question, answer, index of the picture) for each shape in exactly one."""
    in_first, in_second = {o.shape for o in first.objects}, {o.shape for o in second.objects}
    out = []
    for shape in SHAPES:  # a fixed order
        if (shape in in_first) != (shape in in_second):
            index = 0 if shape in in_first else 1
            out.append((f"Which picture has the {shape}?", ("The first picture.", "The second picture.")[index], index))
    return out


def make_item(rng: random.Random, kind: str) -> dict:
    """One question of `kind` with its images and exact answer.

    -> {"kind", "images", "question", "answer", "box" (pixels, grounding only), "image_index"}."""
    if kind == "which_image":
        target = rng.randrange(2)  # which picture has the shape asked about: a fair coin
        while True:
            scenes = [make_scene(rng), make_scene(rng)]
            options = [q for q in pair_questions(*scenes) if q[2] == target]
            if options:
                break
        question, answer, index = rng.choice(options)
        return {"kind": kind, "images": [sc.image for sc in scenes], "question": question, "answer": answer,
                "box": None, "image_index": index}  # fmt: skip
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    while True:
        scene = make_scene(rng)
        options = [q for q in scene.questions() if q[0] == kind]
        if options:
            break
    _, question, answer, obj = rng.choice(options)
    return {"kind": kind, "images": [scene.image], "question": question, "answer": answer,
            "box": obj.box if kind == "grounding" else None, "image_index": 0}  # fmt: skip


def make_eval_set(seed: int, n: int) -> list[dict]:
    """n held-out items, the kinds in turn (n=200: 40 of each), all drawn from random.Random(seed)."""
    rng = random.Random(seed)
    return [make_item(rng, KINDS[i % len(KINDS)]) for i in range(n)]


# With the special tokens, as the model writes it; a decoder that skips special tokens leaves "label(x1,y1),(x2,y2)".
_BOX = re.compile(
    r"(?:<\|object_ref_start\|>)?(?P<label>[^<(]*?)(?:<\|object_ref_end\|>)?\s*(?:<\|box_start\|>)?"
    r"\(\s*(\d+)\s*,\s*(\d+)\s*\)\s*,\s*\(\s*(\d+)\s*,\s*(\d+)\s*\)"
)


def parse_box(text: str) -> tuple[str, tuple[int, int, int, int]] | None:
    """The first grounding answer in text -> (label, (x1, y1, x2, y2) in 0..1000), or None."""
    m = _BOX.search(text)
    if m is None:
        return None
    return m.group("label").strip(), tuple(int(m.group(i)) for i in range(2, 6))


def iou(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> float:
    """Intersection over union of two (x1, y1, x2, y2) boxes in the same units; 0 for an empty one."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = max(0.0, a[2] - a[0]) * max(0.0, a[3] - a[1]) + max(0.0, b[2] - b[0]) * max(0.0, b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


__all__ = ["COLOURS", "KINDS", "SHAPES", "Scene", "Shape", "coverage", "iou", "make_eval_set", "make_item",
           "make_scene", "pair_questions", "parse_box"]  # fmt: skip
