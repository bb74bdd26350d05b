"""LLaVA-NeXT images: any-resolution tiles (the best of `image_grid_pinpoints`, cut into crop-size tiles, plus the
whole image at crop size), a token count from the image size alone, and the LLaVA-1.5 tower + projector whose tile
features are unpadded to the image's aspect ratio and packed with an `image_newline` at the end of every row."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image

from encoders.checkpoint_config import read_config
from encoders.llava import LlavaVisionEncoder
from encoders.llava_processing import LlavaImageProcessing, _image_processor_config, check_tower_size
from encoders.weights import load_components


class TiledGrid(tuple):
    """An image's grid, `(num_crops, h, w)`: the base image and its tiles, each an h x w grid of patches, so that
    `t * h * w` is the patches the ViT sees (pixel_values' rows, the batcher's budget). It also carries the image's
    `(height, width)`, which unpadding the tiles' features needs; `grid_thw` of the ingress is the plain 3-tuple."""

    image_size: tuple[int, int]

    def __new__(cls, grid: tuple[int, int, int], image_size: tuple[int, int]) -> TiledGrid:
        self = super().__new__(cls, grid)
        self.image_size = image_size
        return self

    def __getnewargs__(self) -> tuple[Any, ...]:  # pickle keeps the image size
        return tuple(self), self.image_size


# Adapted from select_best_resolution in transformers/image_processing_utils.py (sizes are (height, width)).
def select_best_resolution(height: int, width: int, pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The pinpoint that keeps the most of the image's pixels when it is fitted in, then wastes the fewest."""
    best, max_effective, min_wasted = pinpoints[0], 0, math.inf
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > max_effective or (effective == max_effective and wasted < min_wasted):
            best, max_effective, min_wasted = (h, w), effective, wasted
    return best


# Adapted from get_patch_output_size in transformers/image_processing_utils.py.
def fitted_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """(height, width) of the image resized to fit `target` (height, width), keeping its aspect ratio."""
    target_h, target_w = target
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_h), target_w
    return target_h, min(math.ceil(width * scale_h), target_w)


# Adapted from unpad_image (transformers/models/llava_next/modeling_llava_next.py) and LlavaNextProcessor.
# _get_unpadded_features: the same float arithmetic, so that counts and features agree with both.
def unpadded_rows_cols(height: int, width: int, rows: int, cols: int) -> tuple[int, int, int, int]:
    """The feature map (rows x cols) of an image padded to its pinpoint, less the padding rows or columns:
    -> (top, rows kept, left, cols kept)."""
    if width / height > cols / rows:  # wider than the pinpoint: padding above and below
        pad = (rows - int(round(height * (cols / width), 7))) // 2
        return pad, rows - 2 * pad, 0, cols
    pad = (cols - int(round(width * (rows / height), 7))) // 2
    return 0, rows, pad, cols - 2 * pad


@dataclass(slots=True, frozen=True)
class LlavaNextImageProcessing:
    """LlavaNextImageProcessor: the image resized and zero-padded to its best pinpoint and cut into crop-size tiles,
    after the whole image resized to `base_size`; each of these crops then goes through LLaVA's CLIP preprocessing."""

    merge_size: ClassVar[int] = 1  # one token per patch
    crop: LlavaImageProcessing  # per crop: resize (short side), centre crop, rescale, normalize (no pad to square)
    image_grid_pinpoints: tuple[tuple[int, int], ...]  # (height, width), multiples of the tile
    base_size: tuple[int, int]  # (height, width) the whole image is resized to before the per-crop steps

    def __post_init__(self) -> None:
        side, _ = self.crop.out_size
        if self.crop.out_size != (side, side):
            raise ValueError(f"crop_size {self.crop.out_size} is not square: LLaVA-NeXT's tiles are")
        if not self.image_grid_pinpoints or any(
            h % side or w % side or h <= 0 or w <= 0 for h, w in self.image_grid_pinpoints
        ):
            raise ValueError(
                f"image_grid_pinpoints {self.image_grid_pinpoints} are not multiples of the {side} px tile"
            )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, config: Any = None) -> LlavaNextImageProcessing:
        """`config`: the checkpoint's transformers config, when the caller has it (encoders.ModelSpec)."""
        cfg = _image_processor_config(Path(model_dir))
        config = config or read_config(model_dir)
        if config.vision_feature_select_strategy != "default":
            # NOTE: transformers' pack_image_features reshapes each tile's features to the patch grid, which the
            # CLS token of "full" does not fit.
            raise ValueError(
                f"vision_feature_select_strategy {config.vision_feature_select_strategy!r} is not "
                "supported for LLaVA-NeXT (only 'default')"
            )
        # NOTE: LlavaNextImageProcessor's do_pad pads the batch to its image with the most tiles, not to a square.
        crop = LlavaImageProcessing.from_config(cfg, patch_size=int(config.vision_config.patch_size))
        pinpoints = tuple((int(h), int(w)) for h, w in cfg.get("image_grid_pinpoints") or config.image_grid_pinpoints)
        if pinpoints != tuple((int(h), int(w)) for h, w in config.image_grid_pinpoints):
            raise ValueError(
                f"preprocessor_config.json's image_grid_pinpoints {list(pinpoints)} differ from "
                f"config.json's {config.image_grid_pinpoints}"
            )
        base = crop.size or (crop.shortest_edge, crop.shortest_edge)  # as LlavaNextImageProcessor._preprocess
        processing = cls(crop=crop, image_grid_pinpoints=pinpoints, base_size=base)
        check_tower_size(crop.out_size, config, "tiles")
        return processing

    @property
    def tile(self) -> int:
        return self.crop.out_size[0]

    @property
    def patches_per_side(self) -> int:
        return self.tile // self.crop.patch_size

    def tiles(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of tiles the image is cut into."""
        h, w = select_best_resolution(height, width, self.image_grid_pinpoints)
        return h // self.tile, w // self.tile

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) covering both sizes the image's pixels are scaled to: fitted to its pinpoint, and base."""
        h, w = fitted_size(height, width, select_best_resolution(height, width, self.image_grid_pinpoints))
        return max(w, self.base_size[1]), max(h, self.base_size[0])

    def num_image_tokens(self, width: int, height: int) -> int:
        """The base image's features, then the tiles' features left after unpadding, one `image_newline` a row."""
        # Adapted from LlavaNextProcessor._get_number_of_features ("default" strategy: the CLS token is dropped).
        n, (rows, cols) = self.patches_per_side, self.tiles(width, height)
        _, kept_rows, _, kept_cols = unpadded_rows_cols(height, width, rows * n, cols * n)
        return n * n + kept_rows * (kept_cols + 1)

    @property
    def max_image_tokens(self) -> int:
        # Unpadding only removes rows or columns, so no image has more tokens than its pinpoint's full feature map;
        # an image of a pinpoint's own size fills it (no other pinpoint holds it with less waste).
        return max(self.num_image_tokens(w, h) for h, w in self.image_grid_pinpoints)

    def worst_case_size(self) -> tuple[int, int]:
        """(width, height) of the pinpoint with the most tokens."""
        h, w = max(self.image_grid_pinpoints, key=lambda p: self.num_image_tokens(p[1], p[0]))
        return w, h

    def fingerprint(self) -> str:
        """Everything about preprocessing that changes an embedding, for cache keys."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        """(1 + tiles, h, w): the crops through the ViT, each h x w patches (see TiledGrid). The LM's 1-D RoPE does
        not use it; the token count is num_image_tokens, not its product."""
        rows, cols = self.tiles(width, height)
        return 1 + rows * cols, self.patches_per_side, self.patches_per_side

    def preprocess(self, image: Image.Image, size: tuple[int, int] | None = None) -> tuple[torch.Tensor, TiledGrid]:
        """RGB image -> (pixel_values (crops*h*w, 3*p*p): the base image's patches then each tile's, tiles in
        row-major order, TiledGrid).

        `size`: the image's (width, height) when it was decoded at a reduced scale; the tiling follows it."""
        # Adapted from LlavaNextImageProcessorPil.get_image_patches and _preprocess (transformers/models/llava_next/
        # image_processing_pil_llava_next.py): fit to the best pinpoint (PIL resize), zero-pad centred, cut tiles;
        # the base is the whole image resized to base_size; every crop then takes the per-crop steps.
        width, height = size or image.size
        best = select_best_resolution(height, width, self.image_grid_pinpoints)
        h, w = fitted_size(height, width, best)
        resample = Image.Resampling(self.crop.resample)
        fitted = np.asarray(image.resize((w, h), resample=resample), dtype=np.uint8)  # (h, w, C)
        top, left = (best[0] - h) // 2, (best[1] - w) // 2
        canvas = np.zeros((*best, 3), dtype=np.uint8)  # (H, W, C), black padding as transformers' np.pad
        canvas[top : top + h, left : left + w] = fitted
        t = self.tile
        crops = [image.resize(self.base_size[::-1], resample=resample)]
        crops += [
            Image.fromarray(canvas[i : i + t, j : j + t]) for i in range(0, best[0], t) for j in range(0, best[1], t)
        ]
        pixel_values = torch.cat([self.crop.preprocess(c)[0] for c in crops])  # (crops*n*n, C*p*p)
        n = self.patches_per_side
        return pixel_values, TiledGrid((len(crops), n, n), (height, width))


class LlavaNextVisionEncoder(LlavaVisionEncoder):
    """LLaVA-1.5's tower and projector on every crop of an image, then LlavaNextModel.pack_image_features."""

    def __init__(
        self, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32, config: Any = None
    ):
        """`config`: the checkpoint's transformers config, when the caller has it (encoders.ModelSpec)."""
        config = config or read_config(model_dir)
        self.processing = LlavaNextImageProcessing.from_pretrained(model_dir, config)
        weights = load_components(model_dir, {"vision"})["vision"]
        if "image_newline" not in weights:
            raise ValueError(f"{model_dir}: no image_newline tensor (a LLaVA-NeXT checkpoint has one)")
        self._load(config, weights, device, dtype)
        self.image_newline = weights["image_newline"].to(device=self.device, dtype=dtype)  # (D,)

    @torch.inference_mode()
    def forward(self, batch: list[tuple[torch.Tensor, tuple[int, int, int]]]) -> list[torch.Tensor]:
        """Preprocessed images (any number of tiles each) in one ViT forward; one (num_image_tokens, llm_hidden)
        tensor per image, as LlavaNextModel.get_image_features' packed output."""
        p, n = self.processing.crop.patch_size, self.processing.patches_per_side
        num_crops = [grid[0] for _, grid in batch]
        x = torch.cat([pv for pv, _ in batch]).to(self.device, self.dtype)  # (N*n*n, C*p*p), N crops in all
        N = sum(num_crops)
        x = x.view(N, n, n, 3, p, p).permute(0, 3, 1, 4, 2, 5).reshape(N, 3, n * p, n * p)  # (N, C, H, W)
        features = self.features(x)  # (N, n*n, D)
        return [self._pack(f, grid) for f, (_, grid) in zip(features.split(num_crops), batch, strict=True)]

    def _pack(self, features: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """(crops, n*n, D) of one image -> (num_image_tokens, D): the base, then the unpadded tile rows, each ending
        in image_newline."""
        # Adapted from LlavaNextModel.pack_image_features (transformers/models/llava_next/modeling_llava_next.py).
        assert isinstance(grid, TiledGrid), "LLaVA-NeXT needs the image size that preprocess puts in its grid"
        height, width = grid.image_size
        n, (rows, cols) = self.processing.patches_per_side, self.processing.tiles(width, height)
        assert features.shape[0] == 1 + rows * cols, (features.shape, rows, cols)
        base, D = features[0], features.shape[-1]  # (n*n, D)
        tiles = features[1:].reshape(rows, cols, n, n, D)  # (rows, cols, n, n, D)
        fmap = tiles.permute(0, 2, 1, 3, 4).reshape(rows * n, cols * n, D)  # (rows*n, cols*n, D)
        top, kept_rows, left, kept_cols = unpadded_rows_cols(height, width, rows * n, cols * n)
        fmap = fmap[top : top + kept_rows, left : left + kept_cols]  # (kept_rows, kept_cols, D)
        newline = self.image_newline.to(fmap).expand(kept_rows, 1, D)  # (kept_rows, 1, D)
        fmap = torch.cat([fmap, newline], dim=1)  # (kept_rows, kept_cols + 1, D)
        return torch.cat([base, fmap.reshape(-1, D)])  # (n*n + kept_rows*(kept_cols + 1), D)


__all__ = ["LlavaNextImageProcessing", "LlavaNextVisionEncoder", "TiledGrid"]
