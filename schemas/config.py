"""The application's static settings: `args:` of serve_config.yaml, validated once when the app is built."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.llm_args import LLMArgs

Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "float32", "bfloat16", "float16"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Limits(_Strict):
    max_request_bytes: int = Field(32 << 20, ge=1024, description="Largest HTTP request body; larger is a 413.")
    max_image_bytes: int = Field(16 << 20, ge=1, description="Largest encoded image (after base64 decoding).")
    max_image_pixels: int = Field(
        4096 * 4096, ge=1, description="Largest width*height of an image, checked on its header before decoding."
    )
    max_aspect_ratio: float = Field(
        200.0, ge=1.0, le=200.0, description="Largest long/short side ratio (Qwen2-VL's smart_resize allows 200)."
    )
    max_images_per_request: int = Field(8, ge=0, description="Most images in one request, all turns together.")
    default_max_tokens: int | None = Field(
        None,
        ge=1,
        description="Cap on the completion length of a request that sets no max_tokens; null: none, the room left in "
        "the context after the prompt (as vLLM and OpenAI).",
    )
    max_n: int = Field(8, ge=1, description="Most choices (n) in one request.")
    max_schema_bytes: int = Field(
        256 << 10,
        ge=1024,
        description="Most bytes of JSON schema (response_format, structured_outputs, the parameters of the tools a "
        "required or named tool_choice compiles; as JSON text), EBNF grammar and regex in one request, together; more "
        "is a 400. The LLM replica compiles them.",
    )
    max_optional_properties: int = Field(
        256,
        ge=0,
        description="Most properties of one JSON-schema object that are not `required`; more is a 400. The grammar's "
        "compile time grows faster than the cube of their number (2,000 took 18 s of a core).",
    )
    max_stop: int = Field(4, ge=0, description="Most stop strings in one request.")
    max_stop_chars: int = Field(64, ge=1, description="Longest stop string, in characters.")
    context_overflow: Literal["error", "drop_oldest_turns"] = Field(
        "error", description="A prompt over the context: a 400, or drop the oldest whole turns (and their images)."
    )
    request_timeout_s: float = Field(
        600.0, gt=0.0, description="Deadline of a request; past it a 408, or an error event on a stream."
    )


class ImageURLArgs(_Strict):
    allow_http: bool = Field(False, description="Fetch http(s) image URLs (off: only data: URLs).")
    allowed_domains: list[str] = Field(
        default_factory=list, description='Hosts images may come from: "example.com", "*.example.com", or "*".'
    )
    allowed_networks: list[str] = Field(
        default_factory=list, description="CIDRs exempt from the block on private addresses (an internal image store)."
    )
    max_redirects: int = Field(3, ge=0, le=10, description="Redirects followed, each one checked again; 0: none.")
    timeout_s: float = Field(10.0, gt=0.0, description="Whole fetch of one image: connect, redirects, body.")
    file_root: str | None = Field(None, description="file:// URLs are served from under this directory; unset: off.")

    @field_validator("allowed_networks")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        for cidr in v:
            ipaddress.ip_network(cidr, strict=False)  # a ValueError names the bad one
        return v

    @model_validator(mode="after")
    def _domains_when_on(self) -> ImageURLArgs:
        if self.allow_http and not self.allowed_domains:
            raise ValueError('image_urls.allow_http needs allowed_domains (hosts, "*.example.com", or "*": any public)')
        return self


class EncoderArgs(_Strict):
    max_batch_patches: int = Field(
        16384, ge=1, description="Patches (14x14 pixels each) packed into one encoder forward across requests."
    )
    max_batch_wait_ms: float = Field(2.0, ge=0.0, description="How long an idle encoder waits to fill a batch.")
    cache_gib: float = Field(
        0.5,
        ge=0.0,
        description="Embedding cache, in GiB (LRU; 0 turns it off): each ingress replica keeps references to the "
        "embeddings the encoder replicas made (they stay in Ray's object store; counted at 4 bytes a value); "
        "colocated, the LLM replica keeps the embeddings themselves.",
    )
    timeout_s: float = Field(
        30.0, gt=0.0, description="Longest wait for an image's embedding; then it is retried once, then 503."
    )
    target_cost_per_replica: float | None = Field(
        None,
        gt=0.0,
        description="Encoder work (GFLOP of ViT + projector, estimated from each image's size) that one Encoder "
        "replica should have queued and running; the cost policy runs ceil(total / this) replicas. Default: the "
        "replica's GFLOP/s, measured at start by the start-up check, times target_queue_delay_s (10 without the "
        "check). The Encoder's autoscaling_config names the policy (without it, Serve's count of requests in "
        "flight, target_ongoing_requests).",
    )
    target_queue_delay_s: float = Field(
        2.0,
        gt=0.0,
        description="The queueing delay the cost policy aims at: the default target cost per replica is this much "
        "of its measured work. Below one large image's encoding time it would count each image in flight as "
        "replicas of need (0.5 s ran 4 replicas where 3 kept up; BENCHMARKS.md).",
    )
    target_utilization: float = Field(
        0.7,
        gt=0.0,
        le=1.0,
        description="The share of a replica's measured rate that arriving work may take: cost arriving faster than "
        "this share of the replicas' rate asks for another replica (the headroom absorbs bursts and the work the "
        "cost estimate leaves out).",
    )
    warm_workers: int = Field(
        2,
        ge=0,
        le=8,
        description="Idle Ray worker processes an Encoder replica keeps on its node (topped up every 5 s while it has "
        "no image to encode) for the next replicas there to start in instead of new processes, with the cluster's "
        "RAY_preload_python_modules imported (`make serve` sets torch): a start then takes 1-2 s, not 3-5. 0: none. "
        "Each holds ~270 MB of resident memory while it waits (an hour at most above Ray's idle limit).",
    )
    jpeg_draft: bool = Field(
        False, description="Decode large JPEGs at reduced size (faster; pixels differ slightly from a full decode)."
    )
    colocated: bool = Field(
        False, description="Encode images inside the LLM replica, on its device, instead of on encoder replicas."
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="An Encoder replica's CPU threads for torch (the ViT on cpu, preprocessing); default: its "
        "`num_cpus`, at least 1 (Ray's rule). Beside the LLM on a small node, the node's cores: images then encode "
        "on them while the LLM waits for them, and the engine's threads follow the node's load (llm.cpu_threads_max).",
    )
    vision_device: Device | None = Field(None, description="Device of the vision tower; default: the app's device.")
    vision_dtype: DType | None = Field(None, description="dtype of the vision tower; default: the app's dtype.")
    projector_device: Device | None = Field(None, description="Device of the projector; default: the tower's.")
    projector_dtype: DType | None = Field(None, description="dtype of the projector (e.g. float32 after a bf16 ViT).")
    startup_check: bool = Field(
        True,
        description="Encode the worst batch at start (max_batch_patches of largest images); refuse to start, saying "
        "why, if it does not fit. An Encoder replica keeps the result (and its measured GFLOP/s) on its node, so a "
        "second one of the same checkpoint, device, dtype and limits reuses it instead of checking again.",
    )


class VideoArgs(_Strict):
    max_videos_per_request: int = Field(
        1, ge=0, description="Most videos in one request, all turns together; 0 refuses video (a 400)."
    )
    max_video_bytes: int = Field(64 << 20, ge=1, description="Largest encoded video (after base64 decoding); a 413.")
    containers: list[str] = Field(
        default_factory=lambda: ["mp4", "webm"],
        description='Containers accepted: "mp4" (MP4 and QuickTime), "webm" (WebM and Matroska).',
    )
    codecs: list[str] = Field(
        default_factory=lambda: ["h264", "hevc", "vp8", "vp9", "av1", "mpeg4"],
        description="Video codecs accepted (FFmpeg's names), read from the container before any decoding.",
    )
    max_width: int = Field(3840, ge=1, description="Widest source frame, from the container's header.")
    max_height: int = Field(2160, ge=1, description="Tallest source frame, from the container's header.")
    max_duration_s: float = Field(600.0, gt=0.0, description="Longest video, in seconds.")
    max_source_frames: int = Field(100_000, ge=1, description="Most frames in the container (before sampling).")
    max_frames: int = Field(
        768, ge=4, le=768, description="Most frames sampled from one video (qwen-vl-utils' 768 is the ceiling)."
    )
    total_pixels: int = Field(
        int(128000 * 28 * 28 * 0.9),
        ge=28 * 28,
        description="Pixel budget of one video's sampled frames: each frame gets at most total_pixels * 2 / frames "
        "(qwen-vl-utils' VIDEO_TOTAL_PIXELS); a request's total_pixels may lower it.",
    )
    max_video_tokens: int = Field(16384, ge=1, description="Most placeholder tokens one video may take.")
    probe_timeout_s: float = Field(
        10.0, gt=0.0, description="Wall-clock limit of the ingress's process that reads one video's container."
    )
    probe_memory_mib: int = Field(
        512, ge=256, description="Address-space limit (RLIMIT_AS) of that probing process, in MiB."
    )
    decode_timeout_s: float = Field(60.0, gt=0.0, description="Wall-clock limit of one video's decoding process.")
    decode_memory_mib: int = Field(
        2048, ge=256, description="Address-space limit (RLIMIT_AS) of one video's decoding process, in MiB."
    )


class AuthArgs(_Strict):
    api_keys: list[str] = Field(
        default_factory=list, description="Accepted API keys (Authorization: Bearer <key>); none at all: no auth."
    )
    api_keys_env: str = Field(
        "VLM_API_KEYS", description="Environment variable of the ingress replica with more keys, comma-separated."
    )
    cors_allow_origins: list[str] = Field(
        default_factory=list, description='Origins browsers may call the API from ("*": any); empty: no CORS.'
    )


class AppArgs(_Strict):
    model: str = Field(description="Path to a Hugging Face-format checkpoint directory (config.json, safetensors).")
    served_model_name: str | None = Field(
        None, description="Name in /v1/models and responses; default: the folder name."
    )
    family: str | None = Field(
        None, description="Model family (qwen2_vl, qwen2_5_vl, llava, llava_next); default: config.json's model_type."
    )
    device: Device = Field("auto", description="auto: cuda in each replica that was given a GPU, else cpu; or set one.")
    dtype: DType = Field("auto", description="Weights and activations: bfloat16 on cuda, float32 on cpu when auto.")
    generation_config: Literal["auto", "vllm"] = Field(
        "auto",
        description="auto: a request that leaves temperature, top_p, top_k, min_p or repetition_penalty out gets the "
        "checkpoint's generation_config.json value; vllm: the API's own defaults (vLLM's --generation-config).",
    )
    limits: Limits = Field(default_factory=Limits, description="Input limits; every one gets a 4xx past it.")
    encoder: EncoderArgs = Field(default_factory=EncoderArgs, description="Encoder replica settings.")
    llm: LLMArgs = Field(default_factory=LLMArgs, description="Language-model replica settings.")
    auth: AuthArgs = Field(default_factory=AuthArgs, description="API keys and CORS at the ingress.")
    image_urls: ImageURLArgs = Field(
        default_factory=ImageURLArgs, description="http(s) and file:// image (and video) URLs."
    )
    video: VideoArgs = Field(default_factory=VideoArgs, description="Video input (Qwen2-VL, Qwen2.5-VL): its limits.")
    tensor_parallel_size: int | None = Field(
        None, ge=1, le=64, description="Shorthand for llm.tensor_parallel_size (the two may not disagree)."
    )

    @model_validator(mode="after")
    def _one_tensor_parallel_size(self) -> AppArgs:
        tp, llm_tp = self.tensor_parallel_size, self.llm.tensor_parallel_size
        if tp is not None and "tensor_parallel_size" in self.llm.model_fields_set and tp != llm_tp:
            raise ValueError(f"tensor_parallel_size={tp} and llm.tensor_parallel_size={llm_tp} disagree; set one")
        if tp is not None:
            self.llm.tensor_parallel_size = tp
        self.tensor_parallel_size = self.llm.tensor_parallel_size
        return self

    @field_validator("model")
    @classmethod
    def _model_dir(cls, v: str) -> str:
        if not (Path(v) / "config.json").is_file():
            raise ValueError(f"model={v!r} is not a checkpoint directory (no config.json there)")
        return str(Path(v).resolve())

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name


__all__ = ["AppArgs", "AuthArgs", "Device", "DType", "EncoderArgs", "ImageURLArgs", "LLMArgs", "Limits", "VideoArgs"]
