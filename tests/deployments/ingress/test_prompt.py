"""Prompt ids: the checkpoint's chat template, one contiguous placeholder run per image, no injected slots."""

from __future__ import annotations

from pathlib import Path

import pytest

from demo.build_tiny import build_checkpoint
from demo.tiny_llava import LLAVA_HF_CHAT_TEMPLATE, build_llava_checkpoint
from demo.tiny_llava_next import build_llava_next_checkpoint
from demo.tiny_qwen2_5_vl import build_qwen2_5_vl_checkpoint
from deployments.ingress.prepare import Preparer
from deployments.ingress.prompt import build_prompt, load_tokenizer
from schemas import AppArgs, InvalidRequest
from schemas.openai import ChatCompletionRequest

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def _messages(*content):
    return ChatCompletionRequest(messages=[{"role": "user", "content": list(content)}]).messages


def test_expands_each_image_to_its_count(checkpoint, reference):
    tokenizer = load_tokenizer(checkpoint)
    pad, start, end = (
        reference.config.image_token_id,
        reference.config.vision_start_token_id,
        reference.config.vision_end_token_id,
    )
    ids = build_prompt(tokenizer, _messages(IMAGE, {"type": "text", "text": "and"}, IMAGE), pad, [[pad] * 6, [pad] * 2])
    assert ids.count(pad) == 8
    first = ids.index(pad)
    assert ids[first - 1] == start and ids[first : first + 6] == [pad] * 6 and ids[first + 6] == end
    second = ids.index(pad, first + 6)
    assert ids[second - 1] == start and ids[second : second + 2] == [pad] * 2 and ids[second + 2] == end
    # The rest is exactly the template's rendering.
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert [t for t in ids if t != pad] == [t for t in tokenizer.encode(text, add_special_tokens=False) if t != pad]
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_typed_placeholder_token_is_rejected(checkpoint, reference):
    tokenizer = load_tokenizer(checkpoint)
    with pytest.raises(InvalidRequest, match=r"2 '<\|image_pad\|>' tokens for 1 images"):
        build_prompt(
            tokenizer,
            _messages(IMAGE, {"type": "text", "text": "look <|image_pad|>"}),
            reference.config.image_token_id,
            [[reference.config.image_token_id] * 4],
        )


@pytest.mark.parametrize("typed", ["<|vision_start|>", "<|vision_end|>", "<|video_pad|>"])
def test_typed_markers_are_rejected(checkpoint, reference, typed):
    cfg, tokenizer = reference.config, load_tokenizer(checkpoint)
    messages = _messages(IMAGE, {"type": "text", "text": f"look {typed}"})
    build_prompt(tokenizer, messages, cfg.image_token_id, [[cfg.image_token_id] * 4])  # without the rule: accepted
    with pytest.raises(InvalidRequest, match="text must not contain that reserved token"):
        build_prompt(
            tokenizer,
            messages,
            cfg.image_token_id,
            [[cfg.image_token_id] * 4],
            [cfg.vision_start_token_id, cfg.vision_end_token_id],
            [cfg.video_token_id],
        )


def test_string_content_and_roles(checkpoint, reference):
    tokenizer = load_tokenizer(checkpoint)
    messages = ChatCompletionRequest(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"},
        ]
    ).messages
    text = tokenizer.decode(build_prompt(tokenizer, messages, reference.config.image_token_id, []))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert "<|im_start|>assistant\nhello<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


# Roles must alternate, as Llama-2's and Mistral's templates (and llava-hf's Mistral LLaVA-NeXT one) demand.
ALTERNATING = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
)


@pytest.mark.parametrize(
    ("template", "fragment"), [(ALTERNATING, "roles must alternate"), ("{{ messages[0]['content'] + 1 }}", "")]
)
def test_a_template_that_refuses_the_messages_is_the_clients_400(checkpoint, reference, template, fragment):
    tokenizer = load_tokenizer(checkpoint)
    tokenizer.chat_template = template
    two_users = ChatCompletionRequest(
        messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    ).messages
    with pytest.raises(InvalidRequest) as e:
        build_prompt(tokenizer, two_users, reference.config.image_token_id, [])
    assert e.value.status == 400 and e.value.param == "messages" and fragment in e.value.message
    assert "chat template refused the messages" in e.value.message


def _llava_hf(out: Path) -> Path:
    return build_llava_checkpoint(out, chat_template=LLAVA_HF_CHAT_TEMPLATE)


# family -> (builder of a tiny checkpoint, whether its template renders typed parts only)
FAMILIES = {
    "qwen2_vl": (lambda out: build_checkpoint(out, seed=0), False),
    "qwen2_5_vl": (build_qwen2_5_vl_checkpoint, False),
    "llava": (build_llava_checkpoint, False),
    "llava_hf_template": (_llava_hf, True),  # llava-hf/llava-1.5-*-hf's own template
    "llava_next": (build_llava_next_checkpoint, False),
}
TURNS = [("system", "Answer in one word."), ("user", "What colour is it?"), ("assistant", "Red."), ("user", "Sure?")]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_string_content_and_its_text_part_give_the_same_prompt(family, tmp_path_factory):
    """llava-hf's template renders typed parts only: a string would vanish from the prompt. The ingress finds such
    templates and sends strings as one text part, so a string and the equivalent part give the same prompt ids."""
    build, typed = FAMILIES[family]
    prep = Preparer(AppArgs(model=str(build(tmp_path_factory.mktemp(family) / family))))
    assert prep.typed_content is typed

    def prompt(as_parts: bool) -> list[int]:
        messages = [
            {"role": role, "content": [{"type": "text", "text": text}] if as_parts else text} for role, text in TURNS
        ]
        req = ChatCompletionRequest(messages=messages, max_tokens=4)
        prep.check(req)
        return prep.prepare(req, {}).prompt

    strings = prompt(as_parts=False)
    assert strings == prompt(as_parts=True)
    text = prep.tokenizer.decode(strings)
    assert all(t in text for _, t in TURNS), text
