"""LLaVA-1.5 images: the CLIP tower + two-layer projector that encodes them (preprocessing: llava_processing.py)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from encoders.checkpoint_config import read_config
from encoders.clip_vit import ClipVisionTower, LlavaProjector
from encoders.cost import VisionCost, linear_flops
from encoders.family import ImageTokens
from encoders.llava_processing import LlavaImageProcessing
from encoders.weights import load_components


def llava_image_tokens(config: Any) -> ImageTokens:
    """`<image>` repeated once per token; no markers around it, no video."""
    return ImageTokens(config.image_token_id, (), ())


def _feature_layers(vision_feature_layer: int | list[int], num_layers: int) -> list[int]:
    """vision_feature_layer (indices into the tower's num_layers + 1 hidden states, may be negative) -> non-negative."""
    layers = [vision_feature_layer] if isinstance(vision_feature_layer, int) else list(vision_feature_layer)
    out = [i + num_layers + 1 if i < 0 else i for i in layers]
    if not layers or not all(0 <= i <= num_layers for i in out):
        raise ValueError(f"vision_feature_layer {vision_feature_layer!r} is out of range for {num_layers} layers")
    return out


def llava_cost(config: Any) -> VisionCost:
    """CLIP's tower up to the deepest feature layer (the rest is never run), full attention over each crop's patches
    and its CLS token, and the two-layer projector. Every LLaVA-1.5 image costs the same (one crop); LLaVA-NeXT's
    grid counts its crops."""
    vc = config.vision_config
    layers = _feature_layers(config.vision_feature_layer, vc.num_hidden_layers)
    d, inter, text = int(vc.hidden_size), int(vc.intermediate_size), int(config.text_config.hidden_size)
    per_patch = (
        linear_flops((3 * vc.patch_size**2, d))
        + max(layers) * linear_flops((d, 3 * d), (d, d), (d, inter), (inter, d))
        + linear_flops((d * len(layers), text), (text, text))
    )
    return VisionCost(per_patch, d, max(layers), extra_tokens=1)


class LlavaVisionEncoder:
    """CLIP's vision tower (only the layers the features come from) and LLaVA's projector, loaded alone from the
    checkpoint's vision weights."""

    def __init__(
        self, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32, config: Any = None
    ):
        """`config`: the checkpoint's transformers config, when the caller has it (encoders.ModelSpec)."""
        config = config or read_config(model_dir)
        self.processing = LlavaImageProcessing.from_pretrained(model_dir, config)
        self._load(config, load_components(model_dir, {"vision"})["vision"], device, dtype)

    def _load(self, config: Any, weights: dict[str, torch.Tensor], device: str, dtype: torch.dtype) -> None:
        """Build the tower and the projector from the vision component's weights (LLaVA-NeXT's encoder too)."""
        # NOTE: the tower and the projector are ours (encoders/clip_vit.py, torch alone), not transformers' modules,
        # whose import pulls in transformers.modeling_utils, torch._dynamo and torch.distributed.tensor (~1.4 CPU-s;
        # LLaVA's transformers config pulls in the last two where it is read: an Encoder replica gets it as data,
        # encoders/checkpoint_config.py, and so imports none: tests/test_replica_imports.py).
        # Their parameters have transformers' names, so the checkpoint's tensors load as they are.
        self.device, self.dtype = torch.device(device), dtype
        vc = config.vision_config
        self.feature_layers = _feature_layers(config.vision_feature_layer, vc.num_hidden_layers)
        self.is_concat = not isinstance(config.vision_feature_layer, int)
        self.keep_cls = config.vision_feature_select_strategy == "full"
        # NOTE: the layers after the deepest selected one never reach the LM (LLaVA-1.5 uses the second to last):
        # they are not built, and their weights are dropped once read.
        num_layers = max(self.feature_layers)
        tower_weights = {
            k.removeprefix("vision_tower."): v
            for k, v in weights.items()
            if k.startswith("vision_tower.") and not _is_dropped(k, num_layers)
        }
        # Older CLIP checkpoints saved the embeddings' `position_ids` (arange, now a non-persistent buffer in
        # transformers, which ignores it): the tower has no such buffer.
        tower_weights.pop("embeddings.position_ids", None)
        projector_weights = {
            k.removeprefix("multi_modal_projector."): v
            for k, v in weights.items()
            if k.startswith("multi_modal_projector.")
        }
        with torch.device("meta"):  # no random init of weights we are about to replace
            tower = ClipVisionTower(vc, num_layers)
            projector = LlavaProjector(config)
        tower.load_state_dict(tower_weights, strict=True, assign=True)
        projector.load_state_dict(projector_weights, strict=True, assign=True)
        assert not any(t.is_meta for t in itertools.chain(tower.parameters(), tower.buffers())), "weights left on meta"
        self.tower = tower.to(device=self.device, dtype=dtype).eval()
        self.projector: nn.Module = projector.to(device=self.device, dtype=dtype).eval()
        self.hidden_size = int(config.text_config.hidden_size)

    def preprocess(self, image: Image.Image, size: tuple[int, int] | None = None):
        return self.processing.preprocess(image, size)

    @torch.inference_mode()
    def forward(self, batch: list[tuple[torch.Tensor, tuple[int, int, int]]]) -> list[torch.Tensor]:
        """Preprocessed images (all the same size) in one batch; one (num_image_tokens, llm_hidden) tensor per image,
        as transformers' LlavaModel.get_image_features."""
        _, gh, gw = batch[0][1]
        assert all(g == batch[0][1] for _, g in batch), "LLaVA images are all preprocessed to the same size"
        p, B = self.processing.patch_size, len(batch)
        x = torch.stack([pv for pv, _ in batch]).to(self.device, self.dtype)  # (B, gh*gw, C*p*p)
        x = x.view(B, gh, gw, 3, p, p).permute(0, 3, 1, 4, 2, 5).reshape(B, 3, gh * p, gw * p)  # (B, C, H, W)
        return list(self.features(x).unbind(0))  # B x (n, D)

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images at the tower's size -> (B, n, D) projected features of the selected layers."""
        # Adapted from LlavaModel.get_image_features in transformers: the hidden states are the embeddings after
        # pre_layrnorm, then each layer's output.
        states = self.tower(pixel_values, self.feature_layers)  # (B, 1 + gh*gw, Dv) each
        selected = [h if self.keep_cls else h[:, 1:] for h in states]  # (B, n, Dv) each
        features = torch.cat(selected, dim=-1) if self.is_concat else selected[0]  # (B, n, Dv * num_layers)
        return self.projector(features)  # (B, n, D)

    def encode(self, images: list[Image.Image]) -> list[torch.Tensor]:
        return self.forward([self.preprocess(im) for im in images])


def _is_dropped(key: str, num_layers: int) -> bool:
    """Weights of the tower's layers past `num_layers` (never used for the features)."""
    prefix = "vision_tower.encoder.layers."
    return key.startswith(prefix) and int(key[len(prefix) :].split(".", 1)[0]) >= num_layers


__all__ = ["LlavaVisionEncoder", "llava_cost", "llava_image_tokens"]
