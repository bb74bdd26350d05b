"""Grounding answers in Qwen's format become boxes: labels, 0..1000 coordinates, then pixels of the image."""

from __future__ import annotations

import pytest

from deployments.ingress.grounding import GroundingTokens, parse_boxes, pixel_boxes
from deployments.ingress.prompt import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_tokenizer(checkpoint)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_boxes_are_parsed_from_token_ids(tokenizer):
    marks = GroundingTokens.of(tokenizer)
    text = (
        "It is <|object_ref_start|>the red circle<|object_ref_end|><|box_start|>(100,250),(300,500)<|box_end|>"
        " and <|box_start|>(900, 10),(20, 80)<|box_end|><|im_end|>"
    )
    assert parse_boxes(_ids(tokenizer, text), marks, tokenizer) == [
        ("the red circle", (100, 250, 300, 500)),
        ("", (20, 10, 900, 80)),
    ]  # corners put in order


@pytest.mark.parametrize(
    "text",
    [
        "no box here",
        "<|box_start|>(1,2),(3<|box_end|>",  # malformed: dropped, never an error
        "<|object_ref_start|>the star<|object_ref_end|><|box_start|>(1,2),(3,4)",  # cut off before its end marker
    ],
)
def test_incomplete_or_missing_boxes_are_none(tokenizer, text):
    assert parse_boxes(_ids(tokenizer, text), GroundingTokens.of(tokenizer), tokenizer) == []


def test_pixels_of_the_last_image(tokenizer):
    ids = _ids(
        tokenizer, "<|object_ref_start|>the blue square<|object_ref_end|><|box_start|>(500,0),(1000,1000)<|box_end|>"
    )
    boxes = pixel_boxes(ids, GroundingTokens.of(tokenizer), tokenizer, [(640, 480), (200, 100)], [0, 3])
    assert [b.model_dump() for b in boxes] == [
        {"label": "the blue square", "image_index": 3, "x1": 100, "y1": 0, "x2": 200, "y2": 100}
    ]
    assert pixel_boxes(ids, GroundingTokens.of(tokenizer), tokenizer, [], []) is None  # no image: no box
    assert pixel_boxes(ids, None, tokenizer, [(640, 480)], [0]) is None  # a family without grounding
