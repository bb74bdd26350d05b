"""What a process knows about the checkpoint it serves, worked out once: `ModelSpec.load` reads the transformers
config (and the generation config and the image preprocessing config) a single time; everything else receives it.

The app builder builds one (so a bad checkpoint or setting fails at deploy time), and so does each replica when it
starts: the ingress, each encoder and each LLM replica (`device` and `dtype` resolve in the process that serves). An
Encoder replica is given the config the app builder read, as data (encoders/checkpoint_config.py), and so reads no
config.json and imports no transformers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from encoders.checkpoint_config import read_config, read_generation_config
from encoders.cost import VisionCost
from encoders.family import Family, ImageProcessing, ImageTokens
from encoders.registry import family_of
from schemas.config import AppArgs
from schemas.resolve import resolve_device, resolve_dtype, resolve_max_model_len


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model_dir: str
    hf_config: Any  # the checkpoint's transformers config (text_config, vision_config, token ids)
    family: Family  # the encoders' registry entry: preprocessing, encoder, image token ids
    image_tokens: ImageTokens  # the placeholder id of an image's run, its markers, the ids a prompt may not carry
    processing: ImageProcessing  # an image's size -> its tokens (merge_size, max_image_tokens)
    max_model_len: int  # the context: admission at the ingress, the KV cache at the LLM
    eos_token_ids: frozenset[int]
    # generation_config.json's sampling values (temperature, top_p, top_k, min_p, repetition_penalty): the defaults
    # of a request that leaves them out; empty with `generation_config: vllm`
    sampling_defaults: dict[str, float]
    device: str  # "cpu" or "cuda", resolved in this process
    dtype: torch.dtype
    image_cost: VisionCost  # a grid's encoding cost in GFLOP (routing, autoscaling, metrics)
    video_processing: Any = None  # the family's video sampling (encoders/video_processing.py); None: no video

    @property
    def text_config(self) -> Any:
        return getattr(self.hf_config, "text_config", self.hf_config)

    @property
    def merge_size(self) -> int:
        return self.processing.merge_size

    @property
    def embedding_width(self) -> int:
        """Columns of an image's embedding: the LM's width, times 1 + the DeepStack levels it carries (Qwen3-VL)."""
        levels = self.family.deepstack_levels(self.hf_config) if self.family.deepstack_levels is not None else 0
        return self.text_config.hidden_size * (1 + levels)

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        *,
        family: str | None = None,
        max_model_len: int | None = None,
        device: str = "auto",
        dtype: str = "auto",
        generation_config: str = "auto",
        config: Any = None,
    ) -> ModelSpec:
        """An unsupported checkpoint, or a `max_model_len` over the checkpoint's positions, raises `ValueError`.
        `config`: the checkpoint's config when the caller has it (an Encoder replica: the app builder's, as a
        ConfigView); else read here (as `family`'s config when the checkpoint names another model_type)."""
        fam = family_of(model_dir, family)  # first: an unsupported model_type fails here, listing the families
        config = read_config(model_dir, family) if config is None else config
        text = getattr(config, "text_config", config)
        dev = resolve_device(device, torch.cuda.is_available())
        generation = read_generation_config(model_dir)
        return cls(
            str(model_dir),
            config,
            fam,
            fam.image_tokens(config),
            fam.processing.from_pretrained(model_dir, config),
            resolve_max_model_len(max_model_len, text.max_position_embeddings),
            frozenset(eos_token_ids(generation, config)),
            sampling_defaults(generation) if generation_config == "auto" else {},
            dev,
            getattr(torch, resolve_dtype(dtype, dev)),
            fam.cost(config),
            fam.video_processing.from_pretrained(model_dir) if fam.video_processing is not None else None,
        )

    @classmethod
    def from_args(cls, args: AppArgs, config: Any = None) -> ModelSpec:
        return cls.load(
            args.model,
            family=args.family,
            max_model_len=args.llm.max_model_len,
            device=args.device,
            dtype=args.dtype,
            generation_config=args.generation_config,
            config=config,
        )


def eos_token_ids(generation: dict[str, Any] | None, config: Any) -> set[int]:
    """generation_config.json's EOS ids (what transformers' generate stops on), else the config's."""
    if generation is not None:
        eos = generation.get("eos_token_id")
    else:  # no generation_config.json
        eos = getattr(getattr(config, "text_config", config), "eos_token_id", None)
    return set([eos] if isinstance(eos, int) else eos or [])


# The values vLLM's `--generation-config auto` takes from the file as its default sampling parameters (max_new_tokens
# aside: here the default max_tokens stays the room left in the context).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(generation: dict[str, Any] | None) -> dict[str, float]:
    """The sampling values generation_config.json sets (transformers 5 leaves the others None)."""
    if generation is None:
        return {}
    out = {k: v for k in SAMPLING_KEYS if (v := generation.get(k)) is not None}
    t, p, k, m, r = (out.get(k) for k in SAMPLING_KEYS)
    if not (
        (t is None or t >= 0) and (p is None or 0 < p <= 1) and (k is None or k >= -1)
        and (m is None or 0 <= m <= 1) and (r is None or r > 0)
    ):  # fmt: skip
        raise ValueError(f"generation_config.json has sampling values out of range: {out}")
    return out


__all__ = ["SAMPLING_KEYS", "ModelSpec", "eos_token_ids", "sampling_defaults"]
