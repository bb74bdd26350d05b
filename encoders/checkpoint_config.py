"""A checkpoint's configs as a process reads them: config.json through transformers (`read_config`: its defaults and
its per-family classes), or, in an Encoder replica, as the plain data the app builder resolved once (`plain_config`
there, `ConfigView` here), so that a new Encoder replica's start imports no transformers at all (~0.8 CPU-s of its
imports: issue 53); generation_config.json as the JSON it is (`read_generation_config`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SUB_CONFIGS = "_sub_configs"  # plain_config's key naming which values are configs themselves (vision_config, ...)


def read_config(model_dir: str | Path, family: str | None = None) -> Any:
    """The checkpoint's transformers config; as `family`'s config when the checkpoint names another model_type."""
    # NOTE: transformers is imported here, on a read, not with this module: an Encoder replica, given the config as
    # data (ConfigView), never loads it.
    from transformers import AutoConfig, PretrainedConfig

    if family is None:
        return AutoConfig.from_pretrained(model_dir)
    config_dict, _ = PretrainedConfig.get_config_dict(model_dir)
    return AutoConfig.for_model(family, **{k: v for k, v in config_dict.items() if k != "model_type"})


def plain_config(config: Any) -> dict[str, Any]:
    """A transformers config as JSON-able data holding all that transformers fills in: its defaults, each
    sub-config's, and the aliases of its `attribute_map` (LLaVA's `image_token_id`, Qwen's vision
    `num_hidden_layers`)."""
    out = config.to_dict()
    subs = [key for key in getattr(config, "sub_configs", {}) if getattr(config, key, None) is not None]
    out.update({key: plain_config(getattr(config, key)) for key in subs})
    out.update({alias: getattr(config, alias) for alias in config.attribute_map})
    out[SUB_CONFIGS] = subs
    return out


class ConfigView:
    """`plain_config`'s data read by attribute, as the transformers config it came from is (`config.vision_config.
    patch_size`, `getattr(config, "text_config", config)`); other dict values (rope_scaling) stay dicts."""

    def __init__(self, data: dict[str, Any]):
        subs = set(data.get(SUB_CONFIGS, ()))
        for key, value in data.items():
            if key != SUB_CONFIGS:
                setattr(self, key, ConfigView(value) if key in subs else value)

    def __repr__(self) -> str:
        return f"ConfigView({getattr(self, 'model_type', '?')})"


def read_generation_config(model_dir: str | Path) -> dict[str, Any] | None:
    """generation_config.json's values (transformers' GenerationConfig reads the same keys), None without one."""
    path = Path(model_dir) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else None


__all__ = ["ConfigView", "plain_config", "read_config", "read_generation_config"]
