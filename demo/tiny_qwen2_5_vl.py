"""Build a tiny, deterministic, random-weight Qwen2.5-VL checkpoint (window-attention ViT) for the tests."""

from __future__ import annotations

import json
from pathlib import Path

# NOTE: the tokenizer, chat template, seeded init and legacy renaming are Qwen2-VL's builder's: Qwen2.5-VL uses the
# same tokenizer, special tokens and chat template, and the same two safetensors layouts.
from demo.build_tiny import SPECIAL_TOKENS, build_tokenizer, init_weights, mrope_section, save_qwen, to_legacy_layout

# OpenAI CLIP statistics, as every Qwen2.5-VL preprocessor_config.json names them.
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def build_qwen2_5_vl_checkpoint(
    out: Path,
    seed: int = 0,
    max_pixels: int = 28 * 28 * 64,
    layout: str = "hub",
    init_std: float = 1.0,
    min_pixels: int = 56 * 56,
) -> Path:
    """Write config, random weights, tokenizer, generation and image-processor configs into `out`.

    The ViT has 3 blocks, block 1 full attention and blocks 0 and 2 windowed; its windows are 2x2 merged tokens
    (window_size 56 px), so every test image above 56x56 is cut into several windows, edge windows partial."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    if layout not in ("hub", "legacy"):
        raise ValueError(f"layout must be 'hub' or 'legacy', got {layout!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]

    hidden_size, num_heads = 64, 4
    text_config = dict(
        vocab_size=-(-len(tokenizer) // 64) * 64,  # padded to a multiple of 64 like real checkpoints
        hidden_size=hidden_size, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=num_heads, num_key_value_heads=2, max_window_layers=2, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,  # Qwen2.5-VL's theta (Qwen2-VL's too)
                         "mrope_section": mrope_section(hidden_size // num_heads)},
        bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot,
    )  # fmt: skip
    # NOTE: unlike Qwen2-VL's, this vision config's hidden_size is the ViT's own width; out_hidden_size is the LM's.
    vision_config = dict(
        depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden_size,
        fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
    )  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=text_config, vision_config=vision_config, tie_word_embeddings=False,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    torch.manual_seed(seed)  # the constructor's own init is overwritten, but keep it reproducible too
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    init_weights(model, seed, init_std)
    save_qwen(model, tokenizer, ids, out)
    # NOTE: written as the hub's Qwen2.5-VL checkpoints write it (top-level min/max_pixels, Qwen2-VL's processor
    # class), not as save_pretrained would (size{}): both forms are in the wild, Qwen2-VL's builder covers the other.
    preprocessor = {
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
    }
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    if layout == "legacy":
        to_legacy_layout(out / "model.safetensors")
    return out


__all__ = ["build_qwen2_5_vl_checkpoint"]
