"""Build a tiny, deterministic, random-weight LLaVA-NeXT checkpoint (any-resolution tiles, `image_newline`, CLIP
tower, two-layer projector, Llama LM) with the LLaVA-1.5 builder's tokenizer and chat template."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from demo.build_tiny import init_weights
from demo.tiny_llava import CHAT_TEMPLATE, SPECIAL_TOKENS, build_llava_tokenizer

# (height, width) pairs, multiples of the crop: 2x2, 2x4, 4x2 and 4x4 tiles of 28 px, so that small test images are
# tiled, padded and unpadded in every direction.
GRID_PINPOINTS: list[list[int]] = [[56, 56], [56, 112], [112, 56], [112, 112]]

# Safetensors key renames from what transformers 5's save_pretrained writes ("hub", llava-hf's names) to the others.
_LAYOUTS: dict[str, tuple[tuple[str, str], ...]] = {
    "hub": (),
    # llava-hf checkpoints made with transformers 4.x: the CLIP tower keeps its `vision_model.` level.
    "legacy": (("vision_tower.", "vision_tower.vision_model."),),
    # What transformers 4.52-4.57 saved: the module paths of the model.
    "prefixed": (
        ("image_newline", "model.image_newline"),
        ("vision_tower.", "model.vision_tower.vision_model."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
    ),
}


def rename_to_layout(weights_path: Path, layout: str) -> None:
    """Rename the keys of a hub-layout safetensors file, in place, to `layout`'s names."""
    from safetensors.torch import load_file, save_file

    renamed = {}
    for key, value in load_file(str(weights_path)).items():
        for old, new in _LAYOUTS[layout]:
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        renamed[key] = value
    save_file(renamed, str(weights_path), metadata={"format": "pt"})


def build_llava_next_checkpoint(
    out: str | Path, seed: int = 0, layout: str = "hub", crop_size: int = 28, patch_size: int = 14,
    grid_pinpoints: list[list[int]] | None = None, feature_layer: int | list[int] = -2, *, init_std: float = 1.0,
    vision_std: float = 0.2,
) -> Path:  # fmt: skip
    """Write config, random weights, tokenizer, chat template, processor and generation configs into `out`.

    CLIP vision: hidden 32, 2 layers, crop_size/patch_size per side (28/14: 4 patches a tile); Llama: hidden 64,
    2 layers. `layout`: "hub" (llava-hf's names, what transformers 5 writes), "legacy" (the tower's `vision_model.`
    level) or "prefixed" (transformers 4.52-4.57)."""
    import torch
    from transformers import GenerationConfig, LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(_LAYOUTS)}, got {layout!r}")
    pinpoints = [list(p) for p in (grid_pinpoints or GRID_PINPOINTS)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_llava_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text_config = dict(
        model_type="llama", vocab_size=-(-len(tokenizer) // 64) * 64,  # padded to a multiple of 64
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"],
    )  # fmt: skip
    vision_config = dict(
        model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, image_size=crop_size, patch_size=patch_size, projection_dim=32,
    )  # fmt: skip
    config = LlavaNextConfig(
        vision_config=vision_config, text_config=text_config, image_token_id=ids["<image>"],
        vision_feature_layer=feature_layer, vision_feature_select_strategy="default", image_grid_pinpoints=pinpoints,
        image_seq_length=(crop_size // patch_size) ** 2, pad_token_id=ids["<pad>"],
    )  # fmt: skip
    torch.manual_seed(seed)  # the constructor's own init is overwritten, but keep it reproducible too
    model = LlavaNextForConditionalGeneration(config).eval()
    init_weights(model, seed, init_std)  # image_newline too: std init_std, like the token embeddings
    with torch.no_grad():
        # NOTE: as in tiny_llava: the unnormalized CLIP residual stream would make image embeddings ~1000x the
        # text ones at the LM's std; a smaller one keeps them comparable.
        for name, param in model.named_parameters():
            if ("vision_tower" in name or "multi_modal_projector" in name) and "norm" not in name:
                param.mul_(vision_std / init_std)
        # Zero output rows: greedy decoding never emits the matrix padding, the placeholder, `<s>` or `<pad>`.
        never = [ids["<image>"], ids["<s>"], ids["<pad>"], *range(len(tokenizer), config.text_config.vocab_size)]
        model.lm_head.weight[never] = 0.0
    model.generation_config = GenerationConfig(
        eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"], bos_token_id=ids["<s>"], do_sample=False
    )
    model.save_pretrained(out)
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": crop_size},
        crop_size={"height": crop_size, "width": crop_size},
        image_grid_pinpoints=pinpoints,
    )
    # As llava-hf's processor_config.json: CLIP's CLS is one more token, dropped by the "default" strategy.
    LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(out)
    image_processor.save_pretrained(out)  # preprocessor_config.json too, as llava-hf checkpoints have it
    if layout != "hub":
        rename_to_layout(out / "model.safetensors", layout)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="demo/llava-next-tiny", help="checkpoint directory")
    parser.add_argument("--layout", choices=sorted(_LAYOUTS), default="hub", help="safetensors key layout")
    args = parser.parse_args(argv)
    print(build_llava_next_checkpoint(args.out, layout=args.layout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
