"""The synthetic scenes: deterministic per seed, answers that are exact for what is drawn, boxes that parse."""

from __future__ import annotations

import random

import numpy as np

from demo.scenes import COLOURS, KINDS, SHAPES, iou, make_eval_set, make_scene, parse_box


def test_the_same_seed_draws_the_same_scenes():
    a, b = make_eval_set(5, 10), make_eval_set(5, 10)
    assert [x["question"] for x in a] == [x["question"] for x in b]
    assert all(
        np.array_equal(np.asarray(p), np.asarray(q)) for x, y in zip(a, b) for p, q in zip(x["images"], y["images"])
    )
    assert [x["kind"] for x in make_eval_set(6, 10)] == [KINDS[i % len(KINDS)] for i in range(10)]


def test_answers_are_exact_for_what_is_drawn():
    rng = random.Random(0)
    for _ in range(30):
        scene = make_scene(rng)
        assert 1 <= len(scene.objects) <= 3 and 112 <= min(scene.image.size) and max(scene.image.size) <= 336
        for kind, _question, answer, obj in scene.questions():
            if kind == "colour":
                assert answer == obj.colour in COLOURS and [o.shape for o in scene.objects].count(obj.shape) == 1
            elif kind == "shape":
                assert answer == obj.shape in SHAPES and [o.colour for o in scene.objects].count(obj.colour) == 1
            elif kind == "count":
                assert answer == str(len(scene.objects))
            else:
                label, box = parse_box(answer)
                assert label == obj.label and box == scene.normalized_box(obj)
        x1, y1, x2, y2 = scene.objects[0].box  # the shape's pixels are inside its box and differ from the corner
        pixels = np.asarray(scene.image)
        assert not np.array_equal(pixels[(y1 + y2) // 2, (x1 + x2) // 2], pixels[0, 0])


def test_iou():
    assert iou((0, 0, 10, 10), (0, 0, 10, 10)) == 1.0
    assert iou((0, 0, 10, 10), (5, 0, 15, 10)) == 50 / 150
    assert iou((0, 0, 1, 1), (2, 2, 3, 3)) == 0.0
