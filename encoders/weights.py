"""Checkpoint layouts: which safetensors keys hold the vision tower, the language model and lm_head.

Qwen2-VL: real hub checkpoints (and what transformers 5 writes) use `visual.*`, `model.*`, `lm_head.*`;
transformers 4.52-4.57 wrote `model.visual.*`, `model.language_model.*`.
LLaVA: llava-hf hub checkpoints use `vision_tower.vision_model.*`, `multi_modal_projector.*`,
`language_model.model.*`, `language_model.lm_head.*`; transformers 5 writes the same without `vision_model.`;
transformers 4.52-4.57 wrote `model.vision_tower.vision_model.*`, `model.multi_modal_projector.*`,
`model.language_model.*`, `lm_head.*`. LLaVA's vision component keeps its sub-prefixes (`vision_tower.*`, as
transformers 5's CLIPVisionModel names them, and `multi_modal_projector.*`): the encoder holds both.
Each replica reads only the tensors of its own components, so the other weights never enter its memory. Here, below
`llm`, whose model reads its own components with it too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

Component = Literal["vision", "text", "lm_head"]

# (prefix, component, what replaces the prefix). First match wins: the longer prefixes must come before the
# short ones they start with (`model.vision_tower.` before `model.`, `model.language_model.` before `model.`).
_PREFIXES: tuple[tuple[str, Component, str], ...] = (
    ("model.visual.", "vision", ""),
    ("visual.", "vision", ""),
    ("model.vision_tower.vision_model.", "vision", "vision_tower."),
    ("model.vision_tower.", "vision", "vision_tower."),
    ("vision_tower.vision_model.", "vision", "vision_tower."),
    ("vision_tower.", "vision", "vision_tower."),
    ("model.multi_modal_projector.", "vision", "multi_modal_projector."),
    ("multi_modal_projector.", "vision", "multi_modal_projector."),
    ("model.image_newline", "vision", "image_newline"),
    ("image_newline", "vision", "image_newline"),
    ("model.language_model.", "text", ""),
    ("language_model.model.", "text", ""),
    ("language_model.lm_head.", "lm_head", ""),
    ("model.", "text", ""),
    ("lm_head.", "lm_head", ""),
)


def split_key(key: str) -> tuple[Component, str] | None:
    """`model.language_model.layers.0.x` -> ("text", "layers.0.x"); None for keys of no component.

    Every layout of a family gives the same names: `vision_tower.vision_model.encoder.layers.0.x` and
    `vision_tower.encoder.layers.0.x` are both ("vision", "vision_tower.encoder.layers.0.x")."""
    for prefix, component, replacement in _PREFIXES:
        if key.startswith(prefix):
            return component, replacement + key[len(prefix) :]
    return None


def _shards(model_dir: Path) -> dict[Path, list[str] | None]:
    """Shard file -> the keys it holds (None: read its own key list)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        by_file: dict[Path, list[str] | None] = {}
        for key, name in json.loads(index.read_text())["weight_map"].items():
            keys = by_file.setdefault(model_dir / name, [])
            assert keys is not None
            keys.append(key)
        return by_file
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return {f: None for f in files}


# (component, name inside it, full shape) -> the slice of the tensor to read, or None to skip it.
Index = Callable[[Component, str, tuple[int, ...]], "tuple[slice, ...] | None"]


def load_components(
    model_dir: str | Path, components: set[Component], index: Index | None = None
) -> dict[Component, dict[str, torch.Tensor]]:
    """Read only the tensors of `components`, keyed by their name inside the component; with `index`, only the
    slice of each that it names (a tensor-parallel rank's shard: the rest is never read from disk)."""
    out: dict[Component, dict[str, torch.Tensor]] = {c: {} for c in components}
    for path, keys in _shards(Path(model_dir)).items():
        if keys is not None and not any((s := split_key(k)) and s[0] in components for k in keys):
            continue  # NOTE: a shard with none of our weights is never opened.
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                split = split_key(key)
                if split is None or split[0] not in components:
                    continue
                if index is None:
                    out[split[0]][split[1]] = f.get_tensor(key)
                    continue
                part = f.get_slice(key)
                where = index(split[0], split[1], tuple(part.get_shape()))
                if where is not None:
                    out[split[0]][split[1]] = part[where]
    return out


__all__ = ["Component", "Index", "load_components", "split_key"]
