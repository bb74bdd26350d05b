"""Prompt token ids from chat messages: the checkpoint's own chat template, then one placeholder run per image."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from schemas import InvalidRequest
from schemas.openai import ImagePart, Message, TextPart, VideoPart


def load_tokenizer(model_dir: str | Path, config: Any = None) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, with its chat template even where only the processor files carry it. `config`:
    the checkpoint's transformers config, when the caller has it (else transformers reads it again)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, **({"config": config} if config is not None else {}))
    if tokenizer.chat_template is None:
        d = Path(model_dir)
        if (d / "chat_template.jinja").is_file():
            tokenizer.chat_template = (d / "chat_template.jinja").read_text()
        elif (d / "chat_template.json").is_file():
            tokenizer.chat_template = json.loads((d / "chat_template.json").read_text())["chat_template"]
        else:
            raise ValueError(f"{model_dir} has no chat template")
    return tokenizer


_PROBE = "vlm-serve content probe 7f3a"


def needs_typed_content(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template renders typed content parts only, so that a string content must go as one text
    part: llava-hf's templates loop `message['content'] | selectattr('type', 'equalto', 'text')`, which drops a
    string. vLLM detects the same from the template's syntax tree (its "openai" content format); here a probe
    message is rendered both ways. A template that renders neither keeps strings as they are."""

    def renders(content: str | list[dict]) -> bool:
        messages = [{"role": "user", "content": content}]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except (TemplateError, TypeError, ValueError):
            return False
        return _PROBE in text

    return not renders(_PROBE) and renders([{"type": "text", "text": _PROBE}])


def template_messages(messages: list[Message], typed_content: bool = False) -> list[dict]:
    """OpenAI messages -> the content format chat templates expect ({"type": "image"} stands for an image,
    {"type": "video"} for a video); with `typed_content` (needs_typed_content), a string content as one text part."""
    out = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        if m.tool_calls or m.role == "tool":
            out.append(_tool_turn(m))
            continue
        if (m.content is None or isinstance(m.content, str)) and typed_content:
            out.append({"role": role, "content": [{"type": "text", "text": m.content}] if m.content else []})
        elif m.content is None or isinstance(m.content, str):
            out.append({"role": role, "content": m.content or ""})
        else:
            parts = [
                {"type": "image"}
                if isinstance(p, ImagePart)
                else {"type": "video"}
                if isinstance(p, VideoPart)
                else {"type": "text", "text": p.text}
                for p in m.content
            ]
            out.append({"role": role, "content": parts})
    return out


def _tool_turn(m: Message) -> dict:
    """An agent loop's assistant message with calls, or a tool's result, as Qwen2.5's template (and vLLM) take
    them: the calls' arguments as objects (the template writes them with `tojson`), content as a string."""
    if isinstance(m.content, list):  # a tool's result may come as text parts
        content = "".join(p.text for p in m.content if isinstance(p, TextPart))
    else:
        content = m.content or ""
    if m.role == "tool":
        return {"role": "tool", "content": content, "tool_call_id": m.tool_call_id} | (
            {"name": m.name} if m.name else {}
        )
    calls = [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)},
        }
        for c in m.tool_calls  # arguments: JSON text, checked by deployments/ingress/tools.py
    ]
    return {"role": "assistant", "content": content, "tool_calls": calls}


def check_reserved(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], expected: dict[int, int], items: str, param: str
):
    """A prompt holds each reserved token (placeholders, markers) `expected[token]` times: another count means the
    client typed them. `items`: what the counts are for ("2 images and 1 videos"), for the message."""
    for token_id, n in expected.items():
        if (found := ids.count(token_id)) != n:
            raise InvalidRequest(
                f"the prompt has {found} {tokenizer.convert_ids_to_tokens(token_id)!r} tokens for {items}: "
                "text must not contain that reserved token",
                param=param,
            )


def build_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[Message],
    image_token_id: int,
    runs: list[list[int]],
    per_image_ids: Iterable[int] = (),
    forbidden_ids: Iterable[int] = (),
    typed_content: bool = False,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    placeholder_ids: list[int] | None = None,
) -> list[int]:
    """Render, tokenize, and replace the template's one placeholder per image (or video) with its run of tokens.

    `runs`: each item's ids in the prompt, in prompt order (its placeholder repeated, or a Qwen3-VL video's
    timestamps and runs: deployments/ingress/prepare.py); `placeholder_ids`: each item's placeholder
    (`image_token_id` for all when None; a video's is the family's video placeholder). The template writes each
    item's placeholder (and each of `per_image_ids`, such as vision start/end markers) once per item and never any
    of `forbidden_ids`: any other count means the user typed them. `typed_content`: the template's
    needs_typed_content; `tools`: the request's, for the template to show."""
    try:
        text = tokenizer.apply_chat_template(
            template_messages(messages, typed_content),
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
    except (TemplateError, TypeError) as e:  # NOTE: a template's raise_exception, or its operations on our input
        raise InvalidRequest(f"the model's chat template refused the messages: {e}", param="messages") from e
    # NOTE: a BOS the template did not write is added, as transformers' processors do (LLaVA's templates leave
    # `<s>` to the tokenizer; Qwen's tokenizer has none).
    bos = tokenizer.bos_token
    ids = tokenizer.encode(text, add_special_tokens=bool(bos) and not text.startswith(bos))
    kinds = placeholder_ids if placeholder_ids is not None else [image_token_id] * len(runs)
    n_items = len(runs)
    expected = (
        {t: 0 for t in forbidden_ids}
        | {t: n_items for t in per_image_ids}
        | {image_token_id: 0}
        | {t: kinds.count(t) for t in kinds}
    )
    n_videos = n_items - kinds.count(image_token_id)
    items = f"{n_items - n_videos} images" + (f" and {n_videos} videos" if n_videos else "")
    check_reserved(tokenizer, ids, expected, items, "messages")
    placeholders = set(kinds)
    slots = [i for i, t in enumerate(ids) if t in placeholders]
    if [ids[i] for i in slots] != kinds:  # NOTE: equal counts, another order: typed tokens swapped with parts
        raise InvalidRequest("the prompt's image and video placeholders are out of order", param="messages")
    expanded: list[int] = []
    prev = 0
    for slot, run in zip(slots, runs, strict=True):
        expanded += ids[prev:slot]
        expanded += run
        prev = slot + 1
    expanded += ids[prev:]
    return expanded


__all__ = ["build_prompt", "check_reserved", "load_tokenizer", "needs_typed_content", "template_messages"]
