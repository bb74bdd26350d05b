"""What the ingress hands the LLM replica (`GenerateRequest`, also what its engine takes), and what the LLM replica
streams back (plain dataclasses: hot path)."""

from __future__ import annotations

from dataclasses import dataclass, field
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

    def __post_init__(self) -> None:
        assert self.max_tokens >= 1, self.max_tokens
        assert 0.0 <= self.temperature and 0.0 < self.top_p <= 1.0, (self.temperature, self.top_p)
        assert self.top_k >= 0 and 0 <= self.top_logprobs <= 20, (self.top_k, self.top_logprobs)
        assert self.repetition_penalty > 0.0 and 0.0 <= self.min_p <= 1.0, (self.repetition_penalty, self.min_p)
        assert 0 <= self.min_tokens <= self.max_tokens, (self.min_tokens, self.max_tokens)
        assert self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, self.prompt_logprobs


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    # One (t, h, w) patch grid per image, in prompt order; with M-RoPE, rows of embeddings = t*h*w / merge_size**2
    # (for 1-D RoPE LMs, the LLaVAs, an image takes as many tokens as `num_image_tokens` or its embedding's rows say).
    image_grid_thw: list[tuple[int, int, int]]
    # One per image: ObjectRefs from the ingress (never the tensors themselves: the ingress must not hold
    # embeddings); the LLM replica puts the fetched (num_image_tokens, D) tensors here before the engine takes it.
    image_embeds: list[Any]
    sampling: SamplingParams
    # One content key per image (hash of its bytes and size): prefix-cache keys for its placeholder tokens.
    image_keys: list[str] = field(default_factory=list)
    # Colocated mode only (`encoder.colocated`): the images' bytes (a video: encoders.video_decode.Video), encoded by
    # the LLM replica itself.
    images: list[Any] = field(default_factory=list)
    # A hash of the conversation's first turn: the LLM request router sends every turn to the replica holding it.
    routing_key: str | None = None
    # The calling ingress replica's id: its tokens come through that ingress's per-step channel to the replica
    # when one is open (deployments/ingress/channel.py); None: all through this call's own stream.
    channel: str | None = None
    # The tenant's scope of the prefix cache (encoders.cache_scope): its blocks chain from a hash of it, so two
    # scopes never share a block; "": the shared cache.
    cache_scope: str = ""
    # One per image or video (or empty: all images): a video's seconds per tubelet (temporal_patch_size / its
    # sampled fps), None for an image. Qwen2.5-VL's temporal positions step by tokens_per_second times it.
    second_per_grid_ts: list[float | None] = field(default_factory=list)
    # One per image or video (or empty: one each): how many of `image_embeds` make it, in order (a video encoded in
    # chunks of tubelets on several encoder replicas); the LLM replica concatenates them.
    embeds_per_item: list[int] = field(default_factory=list)
    # One per image or video (or empty: its embedding's rows, or its M-RoPE grid, say): its placeholder tokens, as the
    # ingress counted them to build the prompt. With them the engine lays out an image before its embedding arrives
    # (prefill overlapped with encoding, 1-D RoPE LMs too); an embedding of another row count fails its sequence.
    num_image_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = sum(self.embeds_per_item) if self.embeds_per_item else len(self.image_grid_thw)
        assert n == len(self.image_embeds) + len(self.images), "one grid per image"
        assert not (self.image_embeds and self.images), "embeddings or bytes, not both"
        assert not self.image_keys or len(self.image_keys) == len(self.image_grid_thw), "one key per image"
        assert not self.second_per_grid_ts or len(self.second_per_grid_ts) == len(self.image_grid_thw)
        assert not self.num_image_tokens or len(self.num_image_tokens) == len(self.image_grid_thw), "one per image"


@dataclass(slots=True)
class TokenLogprob:
    logprob: float  # of the chosen token, from the model's raw distribution
    top: list[tuple[int, float]]  # the most likely (token id, logprob) pairs, best first


@dataclass(slots=True)
class TokenChunk:
    """Token ids generated since the last chunk; `finish_reason` is set on the last one."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    num_cached_tokens: int | None = None  # on the first chunk: prompt tokens whose KV came from the prefix cache
    # On the first chunk, when the request asked (SamplingParams.prompt_logprobs): one per prompt token but the first.
    prompt_logprobs: list[TokenLogprob] | None = None

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


# The per-step token channel's messages (deployments/ingress/channel.py, llm/channel.py)


@dataclass(slots=True)
class Routed:
    """The first item of a generation's own stream when the ingress asked for the channel."""

    replica_id: str
    via_channel: bool


@dataclass(slots=True)
class ChannelOpen:
    """The argument of `LLM.channel`: who listens, and which LLM replica the router must send it to."""

    ingress_id: str
    replica_id: str


Item = TokenChunk | BaseException
Batch = list[tuple[str, Item]]  # one channel message: (request id, chunk or error), in the order they were made


# How often a stopping replica of ours looks whether its requests have ended (Serve's default, 2 s): each deleted app,
# redeploy and scale-down waits at least one look, and a replica that had work two.
DRAIN_POLL_S = 0.5


def this_replica() -> str | None:
    """This Serve replica's unique id; None outside a replica (tests that build a deployment's class directly)."""
    from ray import serve  # NOTE: here: the messages themselves need no Ray

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return None


__all__ = [
    "Batch",
    "ChannelOpen",
    "DRAIN_POLL_S",
    "FinishReason",
    "GenerateRequest",
    "Item",
    "Routed",
    "SamplingParams",
    "TokenChunk",
    "TokenLogprob",
    "this_replica",
]
