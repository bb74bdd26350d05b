"""Request -> prompt for the ingress: limits, image and video headers (each item's record, MediaItem, from here to the
engine), prompt ids, the context-overflow policy, and each choice's sampling parameters. What it gives: a Prepared.
CPU only."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from deployments.ingress.grammar_cost import check_cost
from deployments.ingress.prompt import (
    build_prompt,
    check_reserved,
    load_tokenizer,
    needs_typed_content,
    template_messages,
)
from deployments.ingress.structured import response_grammar
from deployments.ingress.tools import check_tools, renders_tools, template_tools, tool_grammar, tools_as_text
from deployments.ingress.videos import VideoPreparer, video_params
from encoders import ModelSpec, data_url_format, decode_data_url, probe_image
from encoders.video_processing import VideoPlan
from schemas import AppArgs, InvalidRequest, MediaItem, SamplingParams
from schemas.completions import CompletionRequest
from schemas.openai import ChatCompletionRequest, ImagePart, Message, TextPart
from schemas.requests import GenerationRequest


@dataclass(slots=True)
class Prepared:
    """A prompt as preparing gives it: its ids, its images and videos (each its record to the engine), what a choice
    may generate, and where it goes. Each choice's GenerateRequest is built from it."""

    prompt: list[int] = field(default_factory=list)
    items: list[MediaItem] = field(default_factory=list)  # the images and videos the prompt keeps, in prompt order
    video_stats: list[tuple[int, int, float]] = field(default_factory=list)  # (frames, tokens, probe s) received
    max_tokens: int = 0
    dropped_messages: int = 0
    routing_key: str = ""  # the conversation's first turn: which LLM replica holds its prefix (deployments/llm/)
    grammar: str | None = None  # structured outputs: the grammar every choice must match (ingress/structured.py)
    text: str = ""  # a text completion's prompt as text, for echo
    cache_scope: str = ""  # the tenant's scope of the embedding and prefix caches (`cache_scope`)

    @property
    def images(self) -> list[MediaItem]:
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


def embedding_key(content_sha256: str, width: int, height: int, mode: str, preprocessing: str, model: str) -> str:
    """An image's key in the embedding and prefix caches: everything that determines its embedding. Not the bytes
    alone: size and mode are in the key (a 30x100 and a 100x30 image with the same pixel bytes differ), and so are
    the preprocessing settings and the model. A video's is made alike (videos.py), with its sampling."""
    return f"{content_sha256}:{width}x{height}:{mode}:{preprocessing}:{model}"


def cache_scope(tenant: str | None, salt: str | None) -> str:
    """The scope of a request's cache entries, embeddings and prefix KV: its API key's tenant and its `cache_salt`
    (vLLM's field); "" (shared) when it has neither."""
    if tenant is None and salt is None:
        return ""
    return hashlib.blake2b(f"{tenant or ''}\0{salt or ''}".encode(), digest_size=16).hexdigest()


def scoped_key(key: str, scope: str) -> str:
    """An image's or a video's (or chunk's) cache key within a tenant's scope (`cache_scope`; "": the shared cache),
    so that two tenants never share an entry."""
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


def in_prompt_order(req: ChatCompletionRequest, images: list[MediaItem], videos: list[MediaItem]) -> list[MediaItem]:
    """Images and videos merged in the order their parts appear in the messages."""
    it_images, it_videos = iter(images), iter(videos)
    return [
        next(it_images) if isinstance(part, ImagePart) else next(it_videos)
        for m in req.messages
        if isinstance(m.content, list)
        for part in m.content
        if not isinstance(part, TextPart)
    ]


class Preparer:
    def __init__(self, args: AppArgs, spec: ModelSpec | None = None):
        """`spec`: the ingress's (loaded from `args` when not given)."""
        spec = spec or ModelSpec.from_args(args)
        self.args, self.limits = args, args.limits
        self.tokens = spec.image_tokens
        self.image_token_id = self.tokens.placeholder_id
        self.max_images = min(args.limits.max_images_per_request, spec.family.max_images_per_prompt or 1 << 30)
        self.processing = spec.processing
        self.image_cost = spec.image_cost
        self.preprocessing_id = self.processing.fingerprint()
        config_bytes = (Path(args.model) / "config.json").read_bytes()
        self.model_id = hashlib.sha256(args.model.encode() + config_bytes).hexdigest()[:16]
        self.tokenizer = load_tokenizer(args.model, spec.hf_config)
        self.typed_content = needs_typed_content(self.tokenizer)  # llava-hf's templates drop string contents
        self.renders_tools = renders_tools(self.tokenizer)  # else the tools go in a system preamble
        self.max_model_len = spec.max_model_len
        self.sampling_defaults = spec.sampling_defaults  # generation_config.json's, read once with the spec
        # Ids that are tokens and have logits (as vLLM, the tokenizer's; Qwen pads its logits past them).
        self.vocab_size = min(len(self.tokenizer), spec.text_config.vocab_size)
        self.videos = VideoPreparer(args, spec.video_processing, self.model_id, args.model_name)
        self.video_token_id = self.tokens.video_placeholder_id
        # What no prompt may type: video placeholders; what a text completion's may not carry: any of an image's
        # or a video's tokens (it takes no media).
        self.forbidden_ids = self.tokens.forbidden_ids + (() if self.video_token_id is None else (self.video_token_id,))
        reserved = (self.image_token_id, *self.tokens.per_image_ids, *self.forbidden_ids)
        self.reserved = {t: 0 for t in reserved}

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.args.model_name:
            raise InvalidRequest(
                f"model {model!r} is not served here; this server serves {self.args.model_name!r}",
                param="model",
                code="model_not_found",
                status=404,
            )

    def check_generation(self, req: GenerationRequest, num_prompts: int = 1) -> None:
        """The checks chat and text completions share: the model, stop strings, and the choices (n per prompt)."""
        limits = self.limits
        self.check_model(req.model)
        if len(req.stop) > limits.max_stop or any(len(s) > limits.max_stop_chars for s in req.stop):
            raise InvalidRequest(
                f"at most {limits.max_stop} stop strings of at most {limits.max_stop_chars} characters", param="stop"
            )
        if req.n * num_prompts > limits.max_n:
            asked = f"{num_prompts} prompts x n={req.n}" if num_prompts > 1 else f"n={req.n}"
            raise InvalidRequest(f"{asked} is over the limit of {limits.max_n} choices", param="n")
        check_cost(req, limits)  # the schemas' and grammars' size, before any is converted or compiled
        if outside := [t for t in req.logit_bias if not 0 <= t < self.vocab_size]:  # vLLM refuses them too
            raise InvalidRequest(
                f"logit_bias: token id {outside[0]} is outside the vocabulary of {self.vocab_size}", param="logit_bias"
            )
        if req.requested_max_tokens is not None and req.min_tokens > req.requested_max_tokens:
            raise InvalidRequest(
                f"min_tokens {req.min_tokens} is over max_tokens {req.requested_max_tokens}", param="min_tokens"
            )

    def check(self, req: ChatCompletionRequest) -> None:
        """The cheap checks, before any image is read or fetched."""
        self.check_generation(req)
        check_tools(req)
        params = image_params(req)
        if len(params) > self.max_images:
            raise InvalidRequest(f"more than {self.max_images} images in one request", param=params[self.max_images][1])
        self.videos.check(req)

    def _image(
        self, number: int, message: int, param: str, url: str, fetched: dict[str, bytes], scope: str
    ) -> MediaItem:
        try:
            if param in fetched:
                data, declared = fetched[param], None
            else:
                data, declared = decode_data_url(url, self.limits.max_image_bytes), data_url_format(url)
            info = probe_image(data, self.limits, declared)
        except InvalidRequest as e:
            raise InvalidRequest(f"{param}: {e.message}", param=param, code=e.code, status=e.status) from e
        # One key for the embedding cache and for the prefix cache of the image's tokens.
        sha = hashlib.sha256(data).hexdigest()
        key = embedding_key(sha, info.width, info.height, info.mode, self.preprocessing_id, self.model_id)
        key = scoped_key(key, scope)
        grid = self.processing.grid_thw(info.width, info.height)
        num_tokens = self.processing.num_image_tokens(info.width, info.height)
        return MediaItem(
            key,
            grid,
            num_tokens,
            self.image_token_id,
            message=message,
            number=number,
            size=(info.width, info.height),
            cost=self.image_cost.gflop(grid),
            patches=_patches(grid),
            data=data,
        )

    def _video(
        self, message: int, param: str, part, req: ChatCompletionRequest, fetched: dict, scope: str
    ) -> MediaItem:
        v = self.videos.prepare(param, part, req, fetched)
        plan = v.video.plan
        cost = self.image_cost.gflop(plan.grid_thw)
        chunks = tuple(  # a video split into chunks of tubelets (one chunk: the video itself), each an equal share
            MediaItem(
                scoped_key(key, scope),
                data.plan.grid_thw,
                data.plan.num_tokens,
                self.video_token_id,
                message=message,
                cost=cost / len(v.chunks),
                patches=_patches(data.plan.grid_thw),
                data=data,
            )
            for data, key in (v.chunks if len(v.chunks) > 1 else ())
        )
        return MediaItem(
            scoped_key(v.key, scope),
            plan.grid_thw,
            plan.num_tokens,
            self.video_token_id,
            plan.second_per_grid_t,
            tubelet_runs=bool(plan.timestamps),
            message=message,
            size=v.size,
            cost=cost,
            patches=_patches(plan.grid_thw),
            data=v.video,
            chunks=chunks,
            probe_s=v.probe_s,
            run=self._timed_run(plan) if plan.timestamps else None,
        )

    def _timed_run(self, plan: VideoPlan) -> list[int]:
        """Qwen3-VL's video in the prompt: each tubelet's `<t seconds>` then its tokens in vision markers, all in the
        place of the template's one video placeholder (inside the template's own markers, as transformers' processor
        writes it). The timestamp follows a special token, so it is tokenized alone as there."""
        start, end = self.tokens.per_image_ids  # the Qwen families' <|vision_start|>, <|vision_end|>
        per_tubelet = plan.num_tokens // plan.grid_thw[0]
        run: list[int] = []
        for seconds in plan.timestamps:
            run += self.encode(self.videos.processing.timestamp_text(seconds), add_special_tokens=False)
            run += [start, *[self.video_token_id] * per_tubelet, end]
        return run

    def _items(self, req: ChatCompletionRequest, fetched: dict[str, bytes], scope: str) -> list[MediaItem]:
        """The request's images and videos, probed and planned, in prompt order."""
        params = enumerate(image_params(req))
        images = [self._image(n, i, param, url, fetched, scope) for n, (i, param, url) in params]
        videos = [self._video(i, param, part, req, fetched, scope) for i, param, part in video_params(req)]
        return in_prompt_order(req, images, videos)

    def prepare(self, req: ChatCompletionRequest, fetched: dict[str, bytes], scope: str = "") -> Prepared:
        """Image headers, prompt ids and the output's grammar, after `check`; `fetched` holds the bytes of remote
        images by JSON path; `scope`: the tenant's cache scope (`cache_scope`), in every image's key."""
        # First: a schema xgrammar refuses costs no image work. check_tools refused a tool grammar with a format.
        grammar = tool_grammar(req) or response_grammar(req)
        images = self._items(req, fetched, scope)
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
            return self._with_video_stats(self._checked(req, first, grammar, scope), images)
        lo, hi, best = 1, len(starts) - 1, None  # binary search: dropping more turns only shortens the prompt
        while lo <= hi:
            mid = (lo + hi) // 2
            candidate = self._build(req, images, n_system, starts[mid])
            if self._fits(req, candidate):
                best, hi = candidate, mid - 1
            else:
                lo = mid + 1
        p = best or self._build(req, images, n_system, starts[-1])
        return self._with_video_stats(self._checked(req, p, grammar, scope), images)

    def _build(
        self, req: ChatCompletionRequest, images: list[MediaItem], n_system: int, start: int, generation_prompt=True
    ) -> Prepared:
        kept: list[Message] = req.messages[:n_system] + req.messages[start:]
        kept_items = [im for im in images if im.message < n_system or im.message >= start]
        out = Prepared(items=kept_items, dropped_messages=start - n_system)
        out.routing_key = first_turn_key(
            kept[: n_system + 1], [im.key for im in images if im.message < n_system or im.message == start]
        )
        out.prompt = build_prompt(
            self.tokenizer,
            kept if self.renders_tools else tools_as_text(req, kept),
            self.image_token_id,
            [im.prompt_ids for im in kept_items],
            self.tokens.per_image_ids,
            self.forbidden_ids,
            self.typed_content,
            template_tools(req) if self.renders_tools else None,
            generation_prompt,
            [im.placeholder_id for im in kept_items],
        )
        out.max_tokens = self._max_tokens(req, out.prompt)
        return out

    def _max_tokens(self, req: GenerationRequest, prompt: list[int]) -> int:
        """The request's, else the room left in the context (as vLLM), capped by limits.default_max_tokens."""
        room, cap = self.max_model_len - len(prompt), self.limits.default_max_tokens
        return req.requested_max_tokens or (room if cap is None else min(cap, room))

    @staticmethod
    def _with_video_stats(p: Prepared, items: list[MediaItem]) -> Prepared:
        """The request's videos (kept or not) for the metrics: (frames sampled, tokens, probe seconds) each."""
        p.video_stats = [(len(v.data.plan.indices), v.num_tokens, v.probe_s) for v in items if v.is_video]
        return p

    def _fits(self, req: GenerationRequest, p: Prepared) -> bool:
        return p.max_tokens >= 1 and len(p.prompt) + p.max_tokens <= self.max_model_len

    def _checked(
        self, req: GenerationRequest, p: Prepared, grammar: str | None, scope: str, param: str = "messages"
    ) -> Prepared:
        if self._fits(req, p) and req.min_tokens > p.max_tokens:  # max_tokens left out: the room left
            raise InvalidRequest(
                f"min_tokens {req.min_tokens} is over the {p.max_tokens} tokens left in the context after the prompt",
                param="min_tokens",
            )
        if not self._fits(req, p):
            asked = f" + max_tokens {p.max_tokens}" if req.requested_max_tokens else ""
            dropped = f" (after dropping the {p.dropped_messages} oldest messages)" if p.dropped_messages else ""
            raise InvalidRequest(
                f"{len(p.prompt)} prompt tokens{asked} exceed the context length of {self.max_model_len}{dropped}",
                param=param,
                code="context_length_exceeded",
            )
        p.grammar, p.cache_scope = grammar, scope
        return p

    def prompts(self, req: CompletionRequest, scope: str = "") -> list[Prepared]:
        """A text completion's prompts: strings tokenized as vLLM does (the tokenizer's BOS added), token ids
        checked against the vocabulary; none may carry an image's reserved tokens. Each must leave room."""
        self.check_generation(req, len(req.prompts))
        grammar = response_grammar(req)
        out = []
        for k, prompt in enumerate(req.prompts):
            param = "prompt" if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else f"prompt[{k}]"
            if isinstance(prompt, str):
                ids, text = self.encode(prompt), prompt
            else:
                self.check_ids(prompt, param)
                ids, text = prompt, self.tokenizer.decode(prompt) if req.echo else ""
            if not ids:
                raise InvalidRequest("the prompt is empty (no tokens)", param=param)
            check_reserved(self.tokenizer, ids, self.reserved, "0 images", param)
            p = Prepared(prompt=ids, text=text)
            p.max_tokens = self._max_tokens(req, ids)
            out.append(self._checked(req, p, grammar, scope, param))
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A plain prompt's ids, as vLLM makes them: the tokenizer's special tokens (a BOS) added by default."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_ids(self, ids: list[int], param: str) -> None:
        if bad := [t for t in ids if not 0 <= t < self.vocab_size]:
            raise InvalidRequest(f"token id {bad[0]} is not in the vocabulary, 0 to {self.vocab_size - 1}", param=param)

    def tokenize_chat(self, req: ChatCompletionRequest, fetched: dict[str, bytes], generation_prompt: bool) -> list:
        """The prompt ids that prepare() would give the whole conversation (images and videos checked and
        expanded), whether or not they fit the context: /tokenize's answer."""
        return self._build(req, self._items(req, fetched, ""), 0, 0, generation_prompt).prompt


def _patches(grid: tuple[int, int, int]) -> int:
    t, h, w = grid
    return t * h * w


def sampling_params(
    req: GenerationRequest, max_tokens: int, choice: int, grammar: str | None, defaults: dict[str, float]
) -> SamplingParams:
    """The engine's parameters of choice `choice`; a field the request leaves out takes `defaults`' value (the
    checkpoint's generation_config.json, ModelSpec.sampling_defaults) where it has one, else the API's default."""
    seed = None if req.seed is None else (req.seed + choice) % 2**63  # n choices differ, each reproducible

    def pick(name: str, default: float) -> float:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, default)

    temperature = pick("temperature", 1.0)
    return SamplingParams(
        max_tokens=max_tokens,
        # NOTE: as vLLM (_SAMPLING_EPS): below 1e-5 is greedy. Checkpoints ask for 1e-6 in generation_config.json, and
        # a float32 row divided by a subnormal temperature is inf and NaN.
        temperature=temperature if temperature >= 1e-5 else 0.0,
        top_p=pick("top_p", 1.0),
        top_k=max(int(pick("top_k", 0)), 0),
        seed=seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=pick("repetition_penalty", 1.0),
        min_p=pick("min_p", 0.0),
        min_tokens=req.min_tokens,
        logit_bias=dict(req.logit_bias),
        stop_token_ids=frozenset(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        logprobs=req.num_logprobs is not None,
        top_logprobs=req.num_logprobs or 0,
        # NOTE: a prompt's first choice alone computes them (they bypass the prefix cache); its n choices share them.
        prompt_logprobs=req.num_prompt_logprobs if choice == 0 else None,
        grammar=grammar,
        stop=tuple(req.stop),
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
    )


__all__ = [
    "Prepared",
    "Preparer",
    "cache_scope",
    "embedding_key",
    "first_turn_key",
    "image_params",
    "in_prompt_order",
    "sampling_params",
    "scoped_key",
]
