"""What the ingress hands the LLM replica (`GenerateRequest`, also what its engine takes), and what the LLM replica
streams back (plain dataclasses: hot path)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

FinishReason = Literal["stop", "length"]


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # over the prompt and the output, as transformers and vLLM; 1: off
    min_p: float = 0.0  # 0: off
    min_tokens: int = 0  # the stop tokens (EOS unless ignored, stop_token_ids) are masked until this many
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # The prompt's logprobs (each prompt token after the first, given those before it), with the k most likely at
    # each position: vLLM's prompt_logprobs (text completions' echo with logprobs). None: not computed.
    prompt_logprobs: int | None = None
    # Structured outputs: an xgrammar EBNF grammar the output must match (the ingress makes it from response_format
    # or a tool choice; the LLM replica compiles it, once per grammar). None: free text.
    grammar: str | None = None
    # The text's rules, which the ingress's detokenizer applies to the tokens that come back (as vLLM's): stop strings
    # cut the text (after min_tokens tokens), or end it with the string kept (include_stop_str_in_output).
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        assert self.max_tokens >= 1, self.max_tokens
        assert 0.0 <= self.temperature and 0.0 < self.top_p <= 1.0, (self.temperature, self.top_p)
        assert self.top_k >= 0 and 0 <= self.top_logprobs <= 20, (self.top_k, self.top_logprobs)
        assert self.repetition_penalty > 0.0 and 0.0 <= self.min_p <= 1.0, (self.repetition_penalty, self.min_p)
        assert 0 <= self.min_tokens <= self.max_tokens, (self.min_tokens, self.max_tokens)
        assert self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, self.prompt_logprobs


@dataclass(slots=True)
class MediaItem:
    """One image or video of a prompt, one record from the ingress, which reads its header and plans it, to the
    engine, which places its embedding: its key, grid, token count, placeholder, timing, cost and encoder work. The
    ingress keeps its bytes in it; the LLM is sent it without them (`for_engine`): they go to an encoder, and its
    embedding comes back apart, by reference."""

    key: str  # content key: the embedding cache's and the prefix cache's for its tokens ("": never shared)
    grid_thw: tuple[int, int, int]  # its patch grid; with M-RoPE its tokens are t*h*w / merge_size**2
    num_tokens: int  # its placeholder tokens in the prompt, as the ingress counted them
    placeholder_id: int  # the token its run in the prompt is made of
    # A video's seconds per tubelet (its temporal_patch_size / sampled fps): Qwen2.5-VL's temporal positions step by
    # tokens_per_second times it. None: an image.
    second_per_grid_t: float | None = None
    # Qwen3-VL's video: its tokens are one run per tubelet, each after its timestamp's text, and each run is placed
    # as an image of one tubelet (transformers' get_rope_index splits video_grid_thw so). False: one run.
    tubelet_runs: bool = False
    # Encoder tier: where its embedding comes from, piece by piece (one per job, in order), each (encoder call,
    # position): the call's ObjectRef among those sent with the request, and the place in the list that call
    # returned; the LLM concatenates the pieces. Empty when the LLM replica encodes it (colocated).
    pieces: tuple[tuple[int, int], ...] = ()

    # The ingress's: where it is in the request, and the encoder work it takes.
    message: int = 0  # the message it is in
    number: int = -1  # its index among the request's images; -1: a video
    size: tuple[int, int] = (0, 0)  # (width, height)
    cost: float = 0.0  # GFLOP (encoders/cost.py): what the Encoder's router and autoscaling weigh
    patches: int = 0  # ViT patches: a call takes as many jobs as one forward does (encoder.max_batch_patches)
    data: Any = None  # its bytes, or a video's decoded frames (encoders.Video); None in what the LLM is sent
    # A video over one forward's patches, encoded in chunks of tubelets: each chunk its own record (key, grid,
    # tokens, cost, data), in order. Empty: the item is its own one job.
    chunks: tuple[MediaItem, ...] = ()
    probe_s: float = 0.0  # a video's container read
    # The ids its placeholder becomes in the prompt: `placeholder_id` num_tokens times, or (Qwen3-VL's video) each
    # tubelet's timestamp and run in its own vision markers. None: the plain run.
    run: list[int] | None = None

    @property
    def jobs(self) -> tuple[MediaItem, ...]:
        """Its encoder work, each job an embedding's worth: itself, or its chunks."""
        return self.chunks or (self,)

    @property
    def is_video(self) -> bool:
        return self.number < 0

    @property
    def prompt_ids(self) -> list[int]:
        return self.run if self.run is not None else [self.placeholder_id] * self.num_tokens

    def for_engine(self, pieces: tuple[tuple[int, int], ...] = ()) -> MediaItem:
        """The record as the LLM is sent it: no bytes (an encoder has them, or colocated, they go as their own
        argument), no chunks or run (its pieces say where its embedding is)."""
        return replace(self, data=None, chunks=(), run=None, pieces=pieces)


@dataclass(slots=True)
class GenerateRequest:
    """What the ingress hands an LLM replica for one choice (built by keyword), and what its engine takes. The
    embeddings are not in it: `LLM.generate` takes them as their own argument (ObjectRefs of the encoder calls, or
    colocated, each item's bytes), `Engine.submit` as tensors or futures of them."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    items: list[MediaItem] = field(default_factory=list)  # the images and videos, in prompt order
    # A hash of the conversation's first turn: the LLM request router sends every turn to the replica holding it.
    routing_key: str | None = None
    # The calling ingress replica's id: its tokens come through that ingress's per-step channel to the replica
    # when one is open (deployments/channel.py); None: all through this call's own stream.
    channel: str | None = None
    # The tenant's scope of the prefix cache (deployments/ingress/prepare.py `cache_scope`): its blocks chain from a
    # hash of it, so two scopes never share a block; "": the shared cache.
    cache_scope: str = ""


@dataclass(slots=True)
class TokenLogprob:
    logprob: float  # of the chosen token, from the model's raw distribution
    top: list[tuple[int, float]]  # the most likely (token id, logprob) pairs, best first


@dataclass(slots=True)
class TokenChunk:
    """Token ids generated since the last chunk; `finish_reason` is set on the last one. The engine makes them; the
    ingress's detokenizer gives each one its `text` (a choice's delta: deployments/ingress/detokenize.py)."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    num_cached_tokens: int | None = None  # on the first chunk: prompt tokens whose KV came from the prefix cache
    # On the first chunk, when the request asked (SamplingParams.prompt_logprobs): one per prompt token but the first.
    prompt_logprobs: list[TokenLogprob] | None = None
    text: str = ""  # the text of its tokens that can no longer change, stop strings cut (ingress only)

    def merge(self, later: TokenChunk) -> None:
        """Append a later chunk of the same sequence (coalescing several steps into one message)."""
        self.token_ids += later.token_ids
        self.finish_reason = later.finish_reason
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = list(later.logprobs)
            else:
                self.logprobs.extend(later.logprobs)
        if later.num_cached_tokens is not None:
            self.num_cached_tokens = later.num_cached_tokens
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs


__all__ = ["FinishReason", "GenerateRequest", "MediaItem", "SamplingParams", "TokenChunk", "TokenLogprob"]
