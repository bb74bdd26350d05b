"""Grounding answers: Qwen's `<|object_ref_start|>label<|object_ref_end|><|box_start|>(x1,y1),(x2,y2)<|box_end|>`
(coordinates 0..1000 of the image) parsed out of generated token ids."""

from __future__ import annotations

import re
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

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


__all__ = ["GroundingTokens", "MARKERS", "parse_boxes"]
