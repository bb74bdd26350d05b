"""Request -> prompt for the ingress: limits, image headers, prompt ids, and the context-overflow policy. CPU only."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from deployments.ingress.prompt import build_prompt, load_tokenizer, needs_typed_content, template_messages
from deployments.ingress.structured import response_grammar
from deployments.ingress.tools import check_tools, renders_tools, template_tools, tool_grammar
from deployments.ingress.videos import VideoPreparer, video_params
from encoders import data_url_format, decode_data_url, embedding_key, probe_image
from encoders.video_decode import Video
from schemas import AppArgs, InvalidRequest, ModelSpec, SamplingParams
from schemas.openai import ChatCompletionRequest, ImagePart, Message, TextPart


@dataclass(slots=True)
class Prepared:
    prompt: list[int] = field(default_factory=list)
    images: list[bytes | Video] = field(default_factory=list)  # images and videos, in prompt order
    image_keys: list[str] = field(default_factory=list)
    grids: list[tuple[int, int, int]] = field(default_factory=list)
    second_per_grid_ts: list[float | None] = field(default_factory=list)  # a video's seconds per tubelet
    num_videos: int = 0
    # The encoder calls: an image, a video, or a chunk of a video's tubelets each, with its embedding cache key;
    # jobs_per_item[i]: how many of them make item i (the LLM concatenates them in order).
    jobs: list[bytes | Video] = field(default_factory=list)
    job_keys: list[str] = field(default_factory=list)
    jobs_per_item: list[int] = field(default_factory=list)
    video_stats: list[tuple[int, int, float]] = field(default_factory=list)  # (frames, tokens, probe s) received
    max_tokens: int = 0
    dropped_messages: int = 0
    image_sizes: list[tuple[int, int]] = field(default_factory=list)  # (width, height) of each image kept
    image_numbers: list[int] = field(default_factory=list)  # its index among the request's images
    routing_key: str = ""  # the conversation's first turn: which LLM replica holds its prefix (ingress/router.py)
    grammar: str | None = None  # structured outputs: the grammar every choice must match (ingress/structured.py)


@dataclass(slots=True)
class _Image:
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


def sampling_params(req: ChatCompletionRequest, max_tokens: int, choice: int, grammar: str | None) -> SamplingParams:
    seed = None if req.seed is None else (req.seed + choice) % 2**63  # n choices differ, each reproducible
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=max(req.top_k, 0),
        seed=seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        stop_token_ids=frozenset(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs or 0,
        grammar=grammar,
    )


def first_turn_key(first_turn: list[Message], image_keys: list[str]) -> str:
    """A hash of the system messages and the first user turn, with its images' content keys: the same for every
    later turn of the conversation (their prompts start with that turn's tokens), different for another one.

    NOTE: hashing the messages stands for hashing the prefix's token ids (the chat template turns the same messages
    into the same tokens in all families), without templating the first turn a second time."""
    h = hashlib.blake2b(json.dumps(template_messages(first_turn), sort_keys=True).encode(), digest_size=16)
    for key in image_keys:
        h.update(key.encode())
    return h.hexdigest()


class Preparer:
    def __init__(self, args: AppArgs, spec: ModelSpec | None = None):
        """`spec`: the ingress's (loaded from `args` when not given)."""
        spec = spec or ModelSpec.from_args(args)
        self.args, self.limits = args, args.limits
        self.tokens = spec.image_tokens
        self.image_token_id = self.tokens.placeholder_id
        self.max_images = min(args.limits.max_images_per_request, spec.family.max_images_per_prompt or 1 << 30)
        self.processing = spec.processing
        self.preprocessing_id = self.processing.fingerprint()
        config_bytes = (Path(args.model) / "config.json").read_bytes()
        self.model_id = hashlib.sha256(args.model.encode() + config_bytes).hexdigest()[:16]
        self.tokenizer = load_tokenizer(args.model, spec.hf_config)
        self.typed_content = needs_typed_content(self.tokenizer)  # llava-hf's templates drop string contents
        self.renders_tools = renders_tools(self.tokenizer)
        self.max_model_len = spec.max_model_len
        self.videos = VideoPreparer(args, spec.video_processing, self.model_id, args.model_name)
        self.video_token_id = self.tokens.video_placeholder_id

    def check(self, req: ChatCompletionRequest) -> None:
        """The cheap checks, before any image is read or fetched."""
        limits = self.limits
        if req.model is not None and req.model != self.args.model_name:
            raise InvalidRequest(
                f"model {req.model!r} is not served here; this server serves {self.args.model_name!r}",
                param="model",
                code="model_not_found",
                status=404,
            )
        if len(req.stop) > limits.max_stop or any(len(s) > limits.max_stop_chars for s in req.stop):
            raise InvalidRequest(
                f"at most {limits.max_stop} stop strings of at most {limits.max_stop_chars} characters", param="stop"
            )
        if req.n > limits.max_n:
            raise InvalidRequest(f"n={req.n} is over the limit of {limits.max_n}", param="n")
        check_tools(req, self.renders_tools)
        params = image_params(req)
        if len(params) > self.max_images:
            raise InvalidRequest(f"more than {self.max_images} images in one request", param=params[self.max_images][1])
        self.videos.check(req)

    def _image(self, number: int, message: int, param: str, url: str, fetched: dict[str, bytes]) -> _Image:
        try:
            if param in fetched:
                data, declared = fetched[param], None
            else:
                data, declared = decode_data_url(url, self.limits.max_image_bytes), data_url_format(url)
            info = probe_image(data, self.limits, declared)
        except InvalidRequest as e:
            raise InvalidRequest(f"{param}: {e.message}", param=param, code=e.code, status=e.status) from e
        # One key for the embedding cache and for the prefix cache of the image's tokens.
        key = embedding_key(
            hashlib.sha256(data).hexdigest(), info.width, info.height, info.mode, self.preprocessing_id, self.model_id
        )
        return _Image(
            message,
            number,
            (info.width, info.height),
            data,
            key,
            self.processing.grid_thw(info.width, info.height),
            self.processing.num_image_tokens(info.width, info.height),
            self.image_token_id,
        )

    def _video(self, message: int, param: str, part, req: ChatCompletionRequest, fetched: dict) -> _Image:
        v = self.videos.prepare(param, part, req, fetched)
        plan = v.video.plan
        return _Image(message, -1, v.size, v.video, v.key, plan.grid_thw, plan.num_tokens, self.video_token_id,
                      plan.second_per_grid_t, v.chunks, v.probe_s)  # fmt: skip

    def prepare(self, req: ChatCompletionRequest, fetched: dict[str, bytes]) -> Prepared:
        """Image headers, prompt ids and the output's grammar, after `check`; `fetched` holds the bytes of remote
        images by JSON path."""
        # First: a schema xgrammar refuses costs no image work. check_tools refused a tool grammar with a format.
        grammar = tool_grammar(req) or response_grammar(req)
        images = [self._image(n, i, param, url, fetched) for n, (i, param, url) in enumerate(image_params(req))]
        videos = [self._video(i, param, part, req, fetched) for i, param, part in video_params(req)]
        images = _in_prompt_order(req, images, videos)
        overflow = req.context_overflow or self.limits.context_overflow
        # Turns start after the leading system messages (whatever the first one's role: an assistant may open) and
        # at each later user message; dropping whole turns from the front drops their images with them and never
        # cuts inside an image's placeholder run.
        n_system = next(
            (i for i, m in enumerate(req.messages) if m.role not in ("system", "developer")), len(req.messages)
        )
        starts = [n_system] + [i for i, m in enumerate(req.messages) if i > n_system and m.role == "user"]
        first = self._build(req, images, n_system, starts[0])
        if self._fits(req, first) or overflow == "error" or len(starts) == 1:
            return self._checked(req, first, grammar, videos)
        lo, hi, best = 1, len(starts) - 1, None  # binary search: dropping more turns only shortens the prompt
        while lo <= hi:
            mid = (lo + hi) // 2
            candidate = self._build(req, images, n_system, starts[mid])
            if self._fits(req, candidate):
                best, hi = candidate, mid - 1
            else:
                lo = mid + 1
        return self._checked(req, best or self._build(req, images, n_system, starts[-1]), grammar, videos)

    def _build(self, req: ChatCompletionRequest, images: list[_Image], n_system: int, start: int) -> Prepared:
        kept: list[Message] = req.messages[:n_system] + req.messages[start:]
        out = Prepared(dropped_messages=start - n_system)
        kept_items = [im for im in images if im.message < n_system or im.message >= start]
        for image in kept_items:
            out.images.append(image.data)
            out.image_keys.append(image.key)
            out.grids.append(image.grid)
            out.second_per_grid_ts.append(image.second_per_grid_t)
            out.num_videos += image.is_video
            jobs = image.jobs or [(image.data, image.key)]
            out.jobs += [data for data, _ in jobs]
            out.job_keys += [key for _, key in jobs]
            out.jobs_per_item.append(len(jobs))
            if not image.is_video:  # grounding boxes are in pixels of the images
                out.image_sizes.append(image.size)
                out.image_numbers.append(image.number)
        counts = [im.num_tokens for im in kept_items]
        out.routing_key = first_turn_key(
            kept[: n_system + 1], [im.key for im in images if im.message < n_system or im.message == start]
        )
        out.prompt = build_prompt(
            self.tokenizer,
            kept,
            self.image_token_id,
            counts,
            self.tokens.per_image_ids,
            self.tokens.forbidden_ids + ((self.video_token_id,) if self.video_token_id is not None else ()),
            self.typed_content,
            template_tools(req),
            [im.placeholder_id for im in kept_items],
        )
        room, cap = self.max_model_len - len(out.prompt), self.limits.default_max_tokens
        out.max_tokens = req.requested_max_tokens or (room if cap is None else min(cap, room))
        return out

    def _fits(self, req: ChatCompletionRequest, p: Prepared) -> bool:
        return p.max_tokens >= 1 and len(p.prompt) + p.max_tokens <= self.max_model_len

    def _checked(self, req: ChatCompletionRequest, p: Prepared, grammar: str | None, videos: list) -> Prepared:
        p.video_stats = [(len(v.data.plan.indices), v.num_tokens, v.probe_s) for v in videos]
        if not self._fits(req, p):
            asked = f" + max_tokens {p.max_tokens}" if req.requested_max_tokens else ""
            dropped = f" (after dropping the {p.dropped_messages} oldest messages)" if p.dropped_messages else ""
            raise InvalidRequest(
                f"{len(p.prompt)} prompt tokens{asked} exceed the context length of {self.max_model_len}{dropped}",
                param="messages",
                code="context_length_exceeded",
            )
        p.grammar = grammar
        return p


def _in_prompt_order(req: ChatCompletionRequest, images: list[_Image], videos: list[_Image]) -> list[_Image]:
    """Images and videos merged in the order their parts appear in the messages."""
    it_images, it_videos = iter(images), iter(videos)
    return [
        next(it_images) if isinstance(part, ImagePart) else next(it_videos)
        for m in req.messages
        if isinstance(m.content, list)
        for part in m.content
        if not isinstance(part, TextPart)
    ]


__all__ = ["Prepared", "Preparer", "first_turn_key", "image_params", "sampling_params"]
