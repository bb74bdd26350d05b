"""What preparing a request gives: the prompt and its encoder calls (Prepared), and the request's images and videos
(Item) found in its messages, in prompt order. CPU only."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from deployments.ingress.prompt import template_messages
from encoders.video_decode import Video
from schemas.openai import ChatCompletionRequest, ImagePart, Message, TextPart


@dataclass(slots=True)
class Prepared:
    prompt: list[int] = field(default_factory=list)
    images: list[bytes | Video] = field(default_factory=list)  # images and videos, in prompt order
    image_keys: list[str] = field(default_factory=list)
    grids: list[tuple[int, int, int]] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # each item's placeholder tokens in `prompt`
    second_per_grid_ts: list[float | None] = field(default_factory=list)  # a video's seconds per tubelet
    num_videos: int = 0
    # The encoder calls: an image, a video, or a chunk of a video's tubelets each, with its embedding cache key;
    # jobs_per_item[i]: how many of them make item i (the LLM concatenates them in order).
    jobs: list[bytes | Video] = field(default_factory=list)
    job_keys: list[str] = field(default_factory=list)
    jobs_per_item: list[int] = field(default_factory=list)
    job_costs: list[float] = field(default_factory=list)  # each call's encoding cost, GFLOP (encoders/cost.py)
    video_stats: list[tuple[int, int, float]] = field(default_factory=list)  # (frames, tokens, probe s) received
    max_tokens: int = 0
    dropped_messages: int = 0
    image_sizes: list[tuple[int, int]] = field(default_factory=list)  # (width, height) of each image kept
    image_numbers: list[int] = field(default_factory=list)  # its index among the request's images
    routing_key: str = ""  # the conversation's first turn: which LLM replica holds its prefix (ingress/router.py)
    grammar: str | None = None  # structured outputs: the grammar every choice must match (ingress/structured.py)
    text: str = ""  # a text completion's prompt as text, for echo
    cache_scope: str = ""  # the tenant's scope of the embedding and prefix caches (encoders.cache_scope)


@dataclass(slots=True)
class Item:
    """An image or a video of the request."""

    message: int
    number: int  # its index among the request's images (videos: -1)
    size: tuple[int, int]
    data: bytes | Video
    key: str
    grid: tuple[int, int, int]
    num_tokens: int
    placeholder_id: int
    second_per_grid_t: float | None = None  # videos only
    jobs: list[tuple[bytes | Video, str]] = field(default_factory=list)  # its encoder calls; empty: one, itself
    cost: float = 0.0  # its encoding cost, GFLOP (encoders/cost.py)
    probe_s: float = 0.0  # a video's container read

    @property
    def is_video(self) -> bool:
        return isinstance(self.data, Video)


def image_params(req: ChatCompletionRequest) -> list[tuple[int, str, str]]:
    """(message index, JSON path, url) of every image in the request, in order."""
    return [
        (i, f"messages[{i}].content[{j}].image_url", part.image_url.url)
        for i, m in enumerate(req.messages)
        if isinstance(m.content, list)
        for j, part in enumerate(m.content)
        if isinstance(part, ImagePart)
    ]


def scoped_key(key: str, scope: str) -> str:
    """A video's (or chunk's) cache key within a tenant's scope (encoders.cache_scope; "": the shared cache), as
    embedding_key scopes an image's."""
    return key if not scope else hashlib.blake2b(f"{scope}|{key}".encode(), digest_size=16).hexdigest()


def first_turn_key(first_turn: list[Message], image_keys: list[str]) -> str:
    """A hash of the system messages and the first user turn, with its images' content keys: the same for every
    later turn of the conversation (their prompts start with that turn's tokens), different for another one.

    NOTE: hashing the messages stands for hashing the prefix's token ids (the chat template turns the same messages
    into the same tokens in all families), without templating the first turn a second time."""
    h = hashlib.blake2b(json.dumps(template_messages(first_turn), sort_keys=True).encode(), digest_size=16)
    for key in image_keys:
        h.update(key.encode())
    return h.hexdigest()


def in_prompt_order(req: ChatCompletionRequest, images: list[Item], videos: list[Item]) -> list[Item]:
    """Images and videos merged in the order their parts appear in the messages."""
    it_images, it_videos = iter(images), iter(videos)
    return [
        next(it_images) if isinstance(part, ImagePart) else next(it_videos)
        for m in req.messages
        if isinstance(m.content, list)
        for part in m.content
        if not isinstance(part, TextPart)
    ]


__all__ = ["Item", "Prepared", "first_turn_key", "image_params", "in_prompt_order", "scoped_key"]
