"""Grounding answers: Qwen's `<|object_ref_start|>label<|object_ref_end|><|box_start|>(x1,y1),(x2,y2)<|box_end|>`
(coordinates 0..1000 of the image) parsed out of generated token ids."""

from __future__ import annotations

import re
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from schemas.openai import Box

_PAIR = re.compile(r"\(\s*(\d+)\s*,\s*(\d+)\s*\)\s*,\s*\(\s*(\d+)\s*,\s*(\d+)\s*\)")
MARKERS = ("<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>")


@dataclass(frozen=True, slots=True)
class GroundingTokens:
    ref_start: int
    ref_end: int
    box_start: int
    box_end: int

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> GroundingTokens | None:
        """The marker ids, or None for a tokenizer without them (a family that does not ground)."""
        ids = [tokenizer.convert_tokens_to_ids(m) for m in MARKERS]
        if any(i is None or i == tokenizer.unk_token_id for i in ids):
            return None
        return cls(*ids)


def parse_boxes(
    token_ids: list[int], marks: GroundingTokens, tokenizer: PreTrainedTokenizerBase
) -> list[tuple[str, tuple[int, int, int, int]]]:
    """(label, (x1, y1, x2, y2) in 0..1000) of each complete box; a box without a reference gets label ""."""
    out, label, i = [], "", 0
    while i < len(token_ids):
        t = token_ids[i]
        if t == marks.ref_start and marks.ref_end in token_ids[i + 1 :]:
            end = token_ids.index(marks.ref_end, i + 1)
            label, i = tokenizer.decode(token_ids[i + 1 : end]).strip(), end + 1
            continue
        if t == marks.box_start and marks.box_end in token_ids[i + 1 :]:
            end = token_ids.index(marks.box_end, i + 1)
            if (m := _PAIR.fullmatch(tokenizer.decode(token_ids[i + 1 : end]).strip())) is not None:
                x1, y1, x2, y2 = (min(int(v), 1000) for v in m.groups())
                out.append((label, (min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2))))
            label, i = "", end + 1
            continue
        i += 1
    return out


def pixel_boxes(
    token_ids: list[int],
    marks: GroundingTokens | None,
    tokenizer: PreTrainedTokenizerBase,
    image_sizes: list[tuple[int, int]],
    image_numbers: list[int],
) -> list[Box] | None:
    """The answer's grounding boxes in pixels of the image they refer to: the last image of the prompt (Qwen's
    0..1000 coordinates are relative to the image in view)."""
    if marks is None or not image_sizes:
        return None
    (w, h), number = image_sizes[-1], image_numbers[-1]
    return [
        Box(
            label=label,
            image_index=number,
            x1=round(x1 * w / 1000),
            y1=round(y1 * h / 1000),
            x2=round(x2 * w / 1000),
            y2=round(y2 * h / 1000),
        )
        for label, (x1, y1, x2, y2) in parse_boxes(token_ids, marks, tokenizer)
    ] or None


__all__ = ["GroundingTokens", "MARKERS", "parse_boxes", "pixel_boxes"]
