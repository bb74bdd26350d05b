"""Other servers' multimodal message formats become OpenAI content parts, in order; everything else is untouched."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from schemas.openai import ChatCompletionRequest, ImagePart, TextPart

JPEG = "data:image/jpeg;base64,/9j/4AAQSkZJRg=="


def _content(message: dict) -> list:
    return ChatCompletionRequest.model_validate({"messages": [message]}).messages[0].content


def _kinds(parts) -> list[tuple[str, str]]:
    return [("image", p.image_url.url) if isinstance(p, ImagePart) else ("text", p.text) for p in parts]


def test_qwen_vl_and_mindie_items():
    parts = _content(
        {"role": "user", "content": [{"image": JPEG}, {"text": "What is it?"}, {"image": "https://x/y.png"}]}
    )
    assert _kinds(parts) == [("image", JPEG), ("text", "What is it?"), ("image", "https://x/y.png")]


def test_webui_inline_images_in_string_and_text_parts():
    text = f'Compare <img src="{JPEG}"> and<img src="{JPEG}">, please.'
    want = [("text", "Compare "), ("image", JPEG), ("text", " and"), ("image", JPEG), ("text", ", please.")]
    assert _kinds(_content({"role": "user", "content": text})) == want
    assert _kinds(_content({"role": "user", "content": [{"type": "text", "text": text}]})) == want
    assert _kinds(_content({"role": "user", "content": f'<img src="{JPEG}">'})) == [("image", JPEG)]


@pytest.mark.parametrize("text", [
    '<img src="data:image/png;base64,iVBORw0K">',  # webui's tag is exactly jpeg; others stay text
    "<img src='data:image/jpeg;base64,/9j/'>",  # other quoting: not the tag
    '<img src="https://example.com/a.jpg">',  # not inline data
    "no images here",
])  # fmt: skip
def test_text_that_is_not_the_webui_tag_stays_text(text):
    assert _content({"role": "user", "content": text}) == text


def test_only_user_messages_take_inline_images_and_typed_parts_are_untouched():
    text = f'As a system: <img src="{JPEG}">'
    assert (
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]}
        )
        .messages[0]
        .content
        == text
    )
    parts = _content(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": JPEG}}]}
    )
    assert isinstance(parts[0], TextPart) and isinstance(parts[1], ImagePart)


@pytest.mark.parametrize("item", [{"image": JPEG, "text": "both"}, {"img": JPEG}, {"image": 5}, {}])
def test_malformed_items_are_still_refused(item):
    with pytest.raises(ValidationError):
        _content({"role": "user", "content": [item]})
