"""What preparing a request gives: the prompt and its images and videos (Prepared), each one record (Item) from its
header to the engine, with the encoder work it takes (EncoderJob). CPU only."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from deployments.ingress.prompt import template_messages
from encoders.video_decode import Video
from schemas import MediaItem
from schemas.openai import ChatCompletionRequest, ImagePart, Message, TextPart


@dataclass(slots=True)
class EncoderJob:
    """One embedding's worth of encoder work: an image, or a chunk of a video's tubelets."""

    data: bytes | Video
    key: str  # its embedding cache key
    cost: float  # GFLOP (encoders/cost.py): what the Encoder's router and autoscaling weigh
    patches: int  # ViT patches: a call takes as many jobs as one forward does (encoder.max_batch_patches)
    num_tokens: int  # its embedding's rows


@dataclass(slots=True)
class Item:
    """An image or a video of the request: where it is in the messages, its bytes, what the engine needs of it
    (`media`: key, grid, tokens, timing; sent to the LLM as it is) and the encoder work that makes its embedding."""

    message: int
    number: int  # its index among the request's images (videos: -1)
    size: tuple[int, int]  # (width, height)
    data: bytes | Video
    media: MediaItem
    placeholder_id: int
    jobs: list[EncoderJob]  # one, or a video's chunks in order
    probe_s: float = 0.0  # a video's container read
    # The ids its placeholder becomes in the prompt: `placeholder_id` num_tokens times, or (Qwen3-VL's video) each
    # tubelet's timestamp and run in its own vision markers. None: the plain run.
    run: list[int] | None = None

    @property
    def prompt_ids(self) -> list[int]:
        return self.run if self.run is not None else [self.placeholder_id] * self.media.num_tokens

    @property
    def is_video(self) -> bool:
        return isinstance(self.data, Video)

    @property
    def cost(self) -> float:
        return sum(job.cost for job in self.jobs)


@dataclass(slots=True)
class Prepared:
    prompt: list[int] = field(default_factory=list)
    items: list[Item] = field(default_factory=list)  # the images and videos the prompt keeps, in prompt order
    video_stats: list[tuple[int, int, float]] = field(default_factory=list)  # (frames, tokens, probe s) received
    max_tokens: int = 0
    dropped_messages: int = 0
    routing_key: str = ""  # the conversation's first turn: which LLM replica holds its prefix (deployments/llm/)
    grammar: str | None = None  # structured outputs: the grammar every choice must match (ingress/structured.py)
    text: str = ""  # a text completion's prompt as text, for echo
    cache_scope: str = ""  # the tenant's scope of the embedding and prefix caches (encoders.cache_scope)

    @property
    def images(self) -> list[Item]:
        """The images kept (grounding boxes are in pixels of the images)."""
        return [item for item in self.items if not item.is_video]


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


__all__ = ["EncoderJob", "Item", "Prepared", "first_turn_key", "image_params", "in_prompt_order", "scoped_key"]
