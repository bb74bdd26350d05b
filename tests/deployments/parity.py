"""Stack parity, shared by the families: conversations, transformers' own answer to one, and the check that the
deployed app gives the same greedy tokens over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import torch
from ray import serve
from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

from demo.inputs import data_url, make_image
from deployments.app import build_app

MAX_TOKENS = 24  # the tiny checkpoints' greedy margins are checked for this many steps

# A conversation: (role, parts), a part is text or a PIL image.
CASES = {
    "text_only": [("user", ["Tell me about red circles."])],
    "one_image": [("user", [make_image(120, 80, seed=1), "What is in the picture?"])],
    "three_images": [
        (
            "user",
            [
                "Compare",
                make_image(57, 31, seed=2),
                make_image(300, 140, seed=3),
                "and",
                make_image(40, 260, seed=4),
                "please.",
            ],
        )
    ],
    "two_turns": [
        ("user", [make_image(90, 90, seed=5), "What colour is the square?"]),
        ("assistant", ["The square is blue."]),
        ("user", ["And this one?", make_image(200, 60, seed=6)]),
    ],
}


def reference_generate(
    checkpoint, reference, conversation, max_tokens: int = MAX_TOKENS, **generate_kw
) -> tuple[list[int], list[int]]:
    """transformers' own pipeline: chat template, processor grids, placeholder expansion, generate (with
    `generate_kw`: repetition_penalty=...). -> (prompt token ids, greedy completion token ids)."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    processor = AutoImageProcessor.from_pretrained(checkpoint)
    messages, images = [], []
    for role, parts in conversation:
        content = []
        for part in parts:
            if isinstance(part, str):
                content.append({"type": "text", "text": part})
            else:
                content.append({"type": "image"})
                images.append(part)
        messages.append({"role": role, "content": content})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    pad = reference.config.image_token_id
    kwargs = {}
    if images:
        processed = processor(images=images, return_tensors="pt")
        counts = iter((processed["image_grid_thw"].prod(-1) // processor.merge_size**2).tolist())
        ids = [t for tok in ids for t in ([pad] * next(counts) if tok == pad else [tok])]
        kwargs = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = reference.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=(input_ids == pad).int(),
            do_sample=False,
            max_new_tokens=max_tokens,
            **kwargs,
            **generate_kw,
        )
    return ids, out[0, len(ids) :].tolist()


def processor_generate(
    checkpoint, reference, conversation, max_tokens: int = MAX_TOKENS
) -> tuple[list[int], list[int]]:
    """transformers' own pipeline for families whose processor does it all (LLaVA, LLaVA-NeXT): the processor's chat
    template, tokenization, tiling and `<image>` expansion, then generate."""
    processor = AutoProcessor.from_pretrained(checkpoint)
    messages = [
        {
            "role": role,
            "content": [
                {"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts
            ],
        }
        for role, parts in conversation
    ]
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = reference.generate(**inputs, do_sample=False, max_new_tokens=max_tokens)
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist()


def openai_messages(conversation) -> list[dict]:
    messages = []
    for role, parts in conversation:
        content = [
            {"type": "text", "text": p}
            if isinstance(p, str)
            else {"type": "image_url", "image_url": {"url": data_url(p)}}
            for p in parts
        ]
        messages.append({"role": role, "content": content})
    return messages


@contextmanager
def deployed(ray_serve: str, app_args: dict, checkpoint, name: str) -> Iterator[httpx.Client]:
    """The app on `checkpoint` at /<name>, beside any other app of the session, for as long as the block runs."""
    serve.run(build_app({**app_args, "model": str(checkpoint)}), name=name, route_prefix=f"/{name}")
    try:
        with httpx.Client(base_url=f"{ray_serve}/{name}", timeout=60) as client:
            yield client
    finally:
        serve.delete(name)


def greedy_completion(client: httpx.Client, conversation) -> dict:
    """The app's greedy completion of `conversation` (MAX_TOKENS, token ids returned), as its JSON body."""
    body = {"messages": openai_messages(conversation), "max_tokens": MAX_TOKENS, "temperature": 0}
    r = client.post("/v1/chat/completions", json={**body, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def assert_greedy_equals_reference(
    client: httpx.Client, checkpoint, reference, conversation, generate=reference_generate
) -> None:
    """Prompt ids, completion ids, text and usage from the app equal transformers' on the same checkpoint
    (`generate(checkpoint, reference, conversation)`: the family's own transformers pipeline)."""
    ref_prompt, ref_tokens = generate(checkpoint, reference, conversation)
    out = greedy_completion(client, conversation)
    assert out["prompt_token_ids"] == ref_prompt
    assert out["choices"][0]["token_ids"] == ref_tokens
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert out["choices"][0]["message"]["content"] == tokenizer.decode(ref_tokens, skip_special_tokens=True)
    usage = dict(out["usage"])
    assert 0 <= usage.pop("prompt_tokens_details")["cached_tokens"] < len(ref_prompt)  # one token at least is run
    assert usage == {
        "prompt_tokens": len(ref_prompt),
        "completion_tokens": len(ref_tokens),
        "total_tokens": len(ref_prompt) + len(ref_tokens),
    }


__all__ = [
    "greedy_completion",
    "CASES",
    "MAX_TOKENS",
    "assert_greedy_equals_reference",
    "deployed",
    "openai_messages",
    "processor_generate",
    "reference_generate",
]
