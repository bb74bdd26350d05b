"""Qwen2-VL images: token counts from the size alone, preprocessing, and the ViT + merger that encodes them."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from encoders.checkpoint_config import read_config
from encoders.cost import VisionCost, linear_flops
from encoders.family import ImageTokens
from encoders.qwen_vit import Qwen2VLViT
from encoders.weights import load_components
from schemas import InvalidRequest

# OpenAI CLIP statistics, Qwen2-VL's defaults when preprocessor_config.json names none.
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Nearest size with both sides multiples of `factor` and an area within [min_pixels, max_pixels]."""
    # Adapted from transformers/models/qwen2_vl/image_processing_qwen2_vl.py (same rounding, so the same counts).
    if max(height, width) / min(height, width) > 200:
        raise InvalidRequest(
            f"image aspect ratio must be at most 200, got {max(height, width) / min(height, width):.1f}"
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(slots=True, frozen=True)
class Qwen2VLImageProcessing:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = _CLIP_MEAN
    image_std: tuple[float, float, float] = _CLIP_STD

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, config: Any = None) -> Qwen2VLImageProcessing:
        """From preprocessor_config.json alone (`config`, the checkpoint's, is not needed here)."""
        path = Path(model_dir) / "preprocessor_config.json"
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        size, default = cfg.get("size") or {}, cls()
        # Top-level min/max_pixels (older files) win over size{}, as in transformers' image processor.
        min_pixels = cfg.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or default.min_pixels
        max_pixels = cfg.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or default.max_pixels
        return cls(
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            patch_size=int(cfg.get("patch_size", default.patch_size)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", default.temporal_patch_size)),
            merge_size=int(cfg.get("merge_size", default.merge_size)),
            image_mean=tuple(cfg.get("image_mean", _CLIP_MEAN)),
            image_std=tuple(cfg.get("image_std", _CLIP_STD)),
        )

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        h, w = smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)
        return w, h

    @property
    def max_image_tokens(self) -> int:
        return self.max_pixels // (self.patch_size * self.merge_size) ** 2

    def worst_case_size(self) -> tuple[int, int]:
        """(width, height) of an image with (about) the most tokens: a square of max_pixels."""
        side = math.isqrt(self.max_pixels)
        return side, side

    def fingerprint(self) -> str:
        """Everything about preprocessing that changes an embedding, for cache keys."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        w, h = self.resized_size(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def num_image_tokens(self, width: int, height: int) -> int:
        t, h, w = self.grid_thw(width, height)
        return t * h * w // self.merge_size**2

    def preprocess(
        self, image: Image.Image, size: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """RGB image -> (pixel_values (h*w, 3*T*p*p) in merge order, grid (1, h, w)).

        `size`: the (width, height) the target is computed from, when the image was decoded at a reduced scale."""
        p, m, T = self.patch_size, self.merge_size, self.temporal_patch_size
        w, h = self.resized_size(*(size or (image.width, image.height)))
        # NOTE: PIL's resize to the image's own size is a plain copy; skip it.
        resized = image if image.size == (w, h) else image.resize((w, h), resample=Image.Resampling.BICUBIC)
        gh, gw = h // p, w // p
        # NOTE: patchify the uint8 pixels, then convert and normalize: a quarter of the bytes to move, and the
        # same float32 ops on the same values as normalizing first, so the same bits (tests/encoders check them
        # against transformers). 2-4x faster than permuting float32 (make bench-encoder).
        x = np.asarray(resized, dtype=np.uint8).reshape(gh // m, m, p, gw // m, m, p, 3)  # (gh/m, m, p, gw/m, m, p, C)
        x = np.ascontiguousarray(x.transpose(0, 3, 1, 4, 6, 2, 5))  # (gh/m, gw/m, m, m, C, p, p): rows in merge order
        # NOTE: the float buffers come from numpy, not torch: numpy asks for transparent huge pages on big arrays,
        # torch's allocator takes fresh 4 KiB pages for every block above glibc's mmap threshold (32 MiB), and
        # faulting those in cost as much as the arithmetic (1932x1092: 38 -> 18 ms).
        x = torch.from_numpy(x.astype(np.float32)).view(gh * gw, 3, p * p)  # (gh*gw, C, p*p)
        mean = torch.tensor(self.image_mean, dtype=torch.float32).view(1, 3, 1)
        std = torch.tensor(self.image_std, dtype=torch.float32).view(1, 3, 1, 1)
        x.div_(255.0).sub_(mean)
        out = torch.from_numpy(np.empty((gh * gw, 3, T, p * p), dtype=np.float32))  # (gh*gw, C, T, p*p): T frames
        torch.div(x.unsqueeze(2).expand(-1, -1, T, -1), std, out=out)  # the last op writes each frame
        return out.view(gh * gw, 3 * T * p * p), (1, gh, gw)  # (gh*gw, C*T*p*p)


def qwen2_vl_image_tokens(config: Any) -> ImageTokens:
    """`<|vision_start|><|image_pad|>...<|vision_end|>`, and `<|video_pad|>` in the same markers for a video."""
    return ImageTokens(
        config.image_token_id,
        (config.vision_start_token_id, config.vision_end_token_id),
        video_placeholder_id=config.video_token_id,
    )


def qwen_flops_per_patch(vc: Any, width: int, mlp: list[tuple[int, int]], out: int) -> float:
    """Linear FLOPs per patch of a Qwen ViT: the Conv3d patch embedding, each layer's fused q/k/v, output projection
    and MLP (`mlp`: its matrices), and the merger MLP (one row per merge_size**2 patches)."""
    d, m2 = width, vc.spatial_merge_size**2
    embed = linear_flops((vc.in_channels * vc.temporal_patch_size * vc.patch_size**2, d))
    layers = vc.depth * linear_flops((d, 3 * d), (d, d), *mlp)
    return embed + layers + linear_flops((d * m2, d * m2), (d * m2, out)) / m2


def qwen2_vl_cost(config: Any) -> VisionCost:
    """Qwen2-VL's ViT: full attention in every layer over an image's patches (a video's frame's), a GELU MLP of
    embed_dim x mlp_ratio."""
    vc = config.vision_config
    d = int(vc.embed_dim)
    mlp = int(d * vc.mlp_ratio)
    return VisionCost(qwen_flops_per_patch(vc, d, [(d, mlp), (mlp, d)], int(vc.hidden_size)), d, int(vc.depth))


class Qwen2VLVisionEncoder:
    """Qwen2-VL's ViT and patch merger, loaded alone from the checkpoint's `visual.*` weights."""

    out_width = "hidden_size"  # the vision config field that is the LM's width

    # NOTE: the tower is ours (encoders/qwen_vit.py, torch alone), not transformers' module: transformers' modeling
    # pulls in transformers.modeling_utils, torch._dynamo and torch.distributed.tensor (1.4-2 CPU-s of each Encoder
    # replica's start). Its parameters have transformers' names, so `visual.*` loads as it is.
    tower: type[nn.Module] = Qwen2VLViT

    def __init__(
        self, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32, config: Any = None
    ):
        """`config`: the checkpoint's transformers config, when the caller has it (encoders.ModelSpec)."""
        config = (config or read_config(model_dir)).vision_config
        self.processing = Qwen2VLImageProcessing.from_pretrained(model_dir)
        self.device, self.dtype = torch.device(device), dtype
        weights = load_components(model_dir, {"vision"})["vision"]
        with torch.device("meta"):  # no random init of weights we are about to replace
            vit = self.tower(config)
        vit.load_state_dict(weights, strict=True, assign=True)  # the rotary frequencies are no weights: built real
        self.vit = vit.to(device=self.device, dtype=dtype).eval()
        self.hidden_size = int(getattr(config, self.out_width))

    def preprocess(self, image: Image.Image, size: tuple[int, int] | None = None):
        return self.processing.preprocess(image, size)

    @torch.inference_mode()
    def forward(self, batch: list[tuple[torch.Tensor, tuple[int, int, int]]]) -> list[torch.Tensor]:
        """Preprocessed images packed into one ViT forward (attention stays within each image, by cu_seqlens);
        one (num_image_tokens, llm_hidden) tensor per image, as transformers' get_image_features splits them."""
        pixel_values = torch.cat([pv for pv, _ in batch]).to(self.device, self.dtype)  # (sum h*w, C*T*p*p)
        grid_thw = torch.tensor([g for _, g in batch], dtype=torch.long)  # (n, 3): the tower reads it on the CPU
        embeds = self.embed(pixel_values, grid_thw)  # (sum tokens, hidden_size)
        sizes = (grid_thw.prod(-1) // self.processing.merge_size**2).tolist()
        return list(embeds.split(sizes))

    def embed(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The packed images' tokens, (sum tokens, hidden_size): the tower's output (Qwen3-VL's adds its levels)."""
        return self.vit(pixel_values, grid_thw)

    def encode(self, images: list[Image.Image]) -> list[torch.Tensor]:
        return self.forward([self.preprocess(im) for im in images])


__all__ = [
    "Qwen2VLImageProcessing",
    "Qwen2VLVisionEncoder",
    "qwen2_vl_cost",
    "qwen2_vl_image_tokens",
    "qwen_flops_per_patch",
    "smart_resize",
]
