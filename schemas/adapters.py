"""Message content in the formats other multimodal servers accept, turned into OpenAI content parts before
validation, so that every format ends in the same internal request:

- Qwen-VL / MindIE list items without a `type`: `{"image": "<data: or allowed URL>"}`, `{"video": "<URL>"}`,
  `{"video": ["<frame URL>", ...]}` and `{"text": "..."}` (DashScope's and MindIE's multimodal message format);
- text-generation-webui's inline images in a user message's text: `<img src="data:image/jpeg;base64,...">`, the
  exact tag its multimodal extension splits prompts on (extensions/multimodal/multimodal_embedder.py there).
"""

from __future__ import annotations

import re
from typing import Any

WEBUI_IMAGE = re.compile(r'<img src="(data:image/jpeg;base64,[A-Za-z0-9+/=]+)">')


def _untyped(item: Any) -> Any:
    """A Qwen-VL / MindIE item -> an OpenAI part; anything else unchanged (validation judges it)."""
    if not isinstance(item, dict) or "type" in item:
        return item
    if set(item) == {"image"}:
        return {"type": "image_url", "image_url": {"url": item["image"]}}
    if set(item) == {"video"} and isinstance(item["video"], list):
        return {"type": "video_url", "frames": item["video"]}
    if set(item) == {"video"}:
        return {"type": "video_url", "video_url": {"url": item["video"]}}
    if set(item) == {"text"}:
        return {"type": "text", "text": item["text"]}
    return item


def _split_inline(text: str) -> list[dict] | None:
    """Text with webui image tags -> text and image parts in their order; None when it has no tag."""
    parts, at = [], 0
    for m in WEBUI_IMAGE.finditer(text):
        if m.start() > at:
            parts.append({"type": "text", "text": text[at : m.start()]})
        parts.append({"type": "image_url", "image_url": {"url": m.group(1)}})
        at = m.end()
    if not parts:
        return None
    if at < len(text):
        parts.append({"type": "text", "text": text[at:]})
    return parts


def normalize_message(message: Any) -> Any:
    """A raw message dict -> the same with its content in OpenAI parts. Inline images are taken from user messages
    only (images belong there); other roles keep their text as sent."""
    if not isinstance(message, dict):
        return message
    content, user = message.get("content"), message.get("role") == "user"
    if isinstance(content, str) and user and (parts := _split_inline(content)) is not None:
        return {**message, "content": parts}
    if isinstance(content, list):
        out: list[Any] = []
        for item in map(_untyped, content):
            split = _split_inline(item["text"]) if user and isinstance(item, dict) and item.get("type") == "text" \
                and isinstance(item.get("text"), str) else None  # fmt: skip
            out += split if split is not None else [item]
        return {**message, "content": out}
    return message


__all__ = ["WEBUI_IMAGE", "normalize_message"]
