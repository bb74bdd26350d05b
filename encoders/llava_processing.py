"""LLaVA-1.5 preprocessing (LlavaImageProcessor / CLIPImageProcessor): resize, centre-crop or pad to square,
normalize, patchify; every image ends up the same size, so every image has the same token count."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image

from encoders.checkpoint_config import read_config

# OpenAI CLIP statistics: the image processors' defaults when preprocessor_config.json names none.
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _hw(value: Any, what: str) -> tuple[int, int]:
    """A crop/size entry of preprocessor_config.json ({"height", "width"} or an int) -> (height, width)."""
    if isinstance(value, int):
        return value, value
    if isinstance(value, dict) and {"height", "width"} <= value.keys():
        return int(value["height"]), int(value["width"])
    raise ValueError(f"preprocessor_config.json: {what} {value!r} is not supported (an int or height/width)")


@dataclass(slots=True, frozen=True)
class LlavaImageProcessing:
    """LlavaImageProcessor / CLIPImageProcessor: every image ends up `out_size`, so every image has the same count."""

    merge_size: ClassVar[int] = 1  # one token per patch
    shortest_edge: int | None = 224  # resize the short side to this (keeping the aspect ratio) ...
    size: tuple[int, int] | None = None  # ... or resize to exactly (height, width)
    crop_size: tuple[int, int] = (224, 224)  # (height, width)
    do_resize: bool = True
    do_center_crop: bool = True
    do_pad: bool = False  # pad to a square of the image_mean colour before resizing (LLaVA-1.5's "pad" aspect mode)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = _CLIP_MEAN
    image_std: tuple[float, float, float] = _CLIP_STD
    resample: int = int(Image.Resampling.BICUBIC)
    patch_size: int = 14
    num_extra_tokens: int = 0  # 1 with vision_feature_select_strategy "full" (CLS kept), 0 with "default"

    def __post_init__(self) -> None:
        h, w = self.out_size  # raises when the size after preprocessing depends on the image
        if h % self.patch_size or w % self.patch_size:
            raise ValueError(f"preprocessing gives {w}x{h} images, not a multiple of the patch size {self.patch_size}")

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, config: Any = None) -> LlavaImageProcessing:
        """`config`: the checkpoint's transformers config, when the caller has it (encoders.ModelSpec)."""
        cfg = _image_processor_config(Path(model_dir))
        config = config or read_config(model_dir)
        strategy = config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported ('default' or 'full')")
        # NOTE: only LlavaImageProcessor's do_pad pads to a square before resizing; CLIPImageProcessor's pads the
        # batch to its largest image after cropping, a no-op when every image is cropped to the same size.
        is_llava = cfg.get("image_processor_type", "").startswith("LlavaImageProcessor")
        processing = cls.from_config(
            cfg,
            patch_size=int(config.vision_config.patch_size),
            do_pad=bool(cfg.get("do_pad", False)) and is_llava,
            num_extra_tokens=1 if strategy == "full" else 0,
        )
        check_tower_size(processing.out_size, config, "images")
        return processing

    @classmethod
    def from_config(
        cls, cfg: dict[str, Any], *, patch_size: int, do_pad: bool = False, num_extra_tokens: int = 0
    ) -> LlavaImageProcessing:
        """The resize, crop, rescale and normalize settings of an image processor config (preprocessor_config.json)."""
        size = cfg.get("size", {"shortest_edge": 224})
        if isinstance(size, int):  # old feature-extractor files: an int is the short side
            size = {"shortest_edge": size}
        if set(size) == {"shortest_edge"}:
            shortest_edge, exact = int(size["shortest_edge"]), None
        elif set(size) == {"height", "width"}:
            shortest_edge, exact = None, _hw(size, "size")
        else:
            raise ValueError(
                f"preprocessor_config.json: size {size!r} is not supported (shortest_edge, or height and width)"
            )
        return cls(
            shortest_edge=shortest_edge,
            size=exact,
            crop_size=_hw(cfg.get("crop_size", 224), "crop_size"),
            do_resize=bool(cfg.get("do_resize", True)),
            do_center_crop=bool(cfg.get("do_center_crop", True)),
            do_pad=do_pad,
            do_rescale=bool(cfg.get("do_rescale", True)),
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
            do_normalize=bool(cfg.get("do_normalize", True)),
            image_mean=tuple(cfg.get("image_mean") or _CLIP_MEAN),
            image_std=tuple(cfg.get("image_std") or _CLIP_STD),
            resample=int(cfg.get("resample", Image.Resampling.BICUBIC)),
            patch_size=patch_size,
            num_extra_tokens=num_extra_tokens,
        )

    @property
    def out_size(self) -> tuple[int, int]:
        """(height, width) of every preprocessed image."""
        if self.do_center_crop:
            return self.crop_size
        if self.do_resize and self.size is not None:
            return self.size
        if self.do_resize and self.do_pad and self.shortest_edge is not None:
            return self.shortest_edge, self.shortest_edge
        raise ValueError(
            "the image size after preprocessing depends on the image (no centre crop, no fixed size): not supported"
        )

    def _resize_target(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) that `resize` gives an image of this size."""
        # Adapted from get_resize_output_image_size (default_to_square=False) in transformers/image_transforms.py.
        if not self.do_resize:
            return height, width
        if self.size is not None:
            return self.size
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the image's own pixels are scaled to (before any crop; inside the square when padding)."""
        if self.do_pad:
            side = max(width, height)
            h, w = self._resize_target(side, side)
            return max(1, round(width * w / side)), max(1, round(height * h / side))
        h, w = self._resize_target(width, height)
        return w, h

    @property
    def max_image_tokens(self) -> int:
        h, w = self.out_size
        return (h // self.patch_size) * (w // self.patch_size) + self.num_extra_tokens

    def worst_case_size(self) -> tuple[int, int]:
        """Every image costs the same: one of the crop's size."""
        h, w = self.out_size
        return w, h

    def fingerprint(self) -> str:
        """Everything about preprocessing that changes an embedding, for cache keys."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        h, w = self.out_size
        return 1, h // self.patch_size, w // self.patch_size

    def num_image_tokens(self, width: int, height: int) -> int:
        return self.max_image_tokens

    def preprocess(
        self, image: Image.Image, size: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """RGB image -> (pixel_values (h*w, 3*p*p): the patches in row-major order, grid (1, h, w)).

        `size`: the (width, height) the resize is computed from, when the image was decoded at a reduced scale."""
        # Adapted from LlavaImageProcessorPil._preprocess (transformers/models/llava/image_processing_pil_llava.py):
        # pad to square, resize (PIL), centre crop, rescale, normalize, the same ops in the same order and dtypes.
        if self.do_pad and image.width != image.height:
            side = max(image.size)
            background = tuple(int(x * 255) for x in self.image_mean)
            square = Image.new("RGB", (side, side), background)
            square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
            image, size = square, None
        h, w = self._resize_target(*(size or image.size))
        if self.do_resize:
            image = image.resize((w, h), resample=Image.Resampling(self.resample))
        x = np.asarray(image, dtype=np.uint8)  # (H, W, C)
        if self.do_center_crop:
            x = _center_crop(x, *self.crop_size)  # (ch, cw, C)
        p = self.patch_size
        gh, gw = x.shape[0] // p, x.shape[1] // p
        # NOTE: one row per patch, so that the batcher's patch budget counts what the ViT will see; patchify the
        # uint8 pixels (a quarter of the bytes), then the same float ops on the same values as transformers.
        x = np.ascontiguousarray(x.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3))  # (gh, gw, C, p, p)
        x = x.astype(np.float64) * self.rescale_factor if self.do_rescale else x  # transformers rescales in float64
        x = x.astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.image_mean, dtype=np.float32).reshape(3, 1, 1)
            std = np.array(self.image_std, dtype=np.float32).reshape(3, 1, 1)
            x = (x - mean) / std
        return torch.from_numpy(x.reshape(gh * gw, 3 * p * p)), (1, gh, gw)  # (gh*gw, C*p*p)


def check_tower_size(out_size: tuple[int, int], config: Any, what: str) -> None:
    """Preprocessing must give the square the CLIP tower was trained on (config.vision_config.image_size)."""
    side = int(config.vision_config.image_size)
    if out_size != (side, side):
        h, w = out_size
        raise ValueError(f"preprocessing gives {w}x{h} {what} but the vision tower takes {side}x{side}")


def _image_processor_config(model_dir: Path) -> dict[str, Any]:
    """preprocessor_config.json, or the image processor nested in processor_config.json (transformers 5 saves it
    there); {} (the defaults) when neither exists."""
    if (path := model_dir / "preprocessor_config.json").is_file():
        return json.loads(path.read_text())
    if (path := model_dir / "processor_config.json").is_file():
        return json.loads(path.read_text()).get("image_processor", {})
    return {}


def _center_crop(x: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    """(H, W, C) -> (crop_h, crop_w, C); an image smaller than the crop is padded with zeros around it."""
    # Adapted from center_crop in transformers/image_transforms.py (same offsets, same zero padding).
    H, W = x.shape[:2]
    top, left = (H - crop_h) // 2, (W - crop_w) // 2
    if top >= 0 and left >= 0:
        return x[top : top + crop_h, left : left + crop_w]
    new_h, new_w = max(crop_h, H), max(crop_w, W)
    padded = np.zeros((new_h, new_w, x.shape[2]), dtype=x.dtype)  # (new_h, new_w, C)
    top_pad, left_pad = math.ceil((new_h - H) / 2), math.ceil((new_w - W) / 2)
    padded[top_pad : top_pad + H, left_pad : left_pad + W] = x
    top, left = top + top_pad, left + left_pad
    return padded[max(0, top) : min(new_h, top + crop_h), max(0, left) : min(new_w, left + crop_w)]


__all__ = ["LlavaImageProcessing"]
