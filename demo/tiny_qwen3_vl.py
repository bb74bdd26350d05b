"""Build a tiny, deterministic, random-weight Qwen3-VL checkpoint (ViT with learned position embeddings and DeepStack
mergers, interleaved-M-RoPE Qwen3 LM) for the tests."""

from __future__ import annotations

import json
from pathlib import Path

# NOTE: the tokenizer and seeded init are Qwen2-VL's builder's: Qwen3-VL keeps Qwen2-VL's vision special tokens
# (<|vision_start|>, <|image_pad|>, <|video_pad|>, ...), which is all the tests of the tower and its token counts need.
from demo.build_tiny import SPECIAL_TOKENS, build_tokenizer, init_weights, save_qwen

# Qwen3-VL's preprocessor_config.json normalizes with mean = std = 0.5 (not CLIP's statistics, as Qwen2-VL did).
_HALF = [0.5, 0.5, 0.5]


def build_qwen3_vl_checkpoint(
    out: Path,
    seed: int = 0,
    *,
    init_std: float = 1.0,
    vision_std: float = 0.2,
    deepstack_gain: float = 150.0,
    min_pixels: int = 64 * 64,
    max_pixels: int = 32 * 32 * 64,
    video_pixels: int = 6 * 96 * 128,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vision_hidden_size: int = 32,
    vision_depth: int = 4,
    vision_heads: int = 2,
    vision_mlp_ratio: int = 2,
    deepstack_indexes: tuple[int, ...] = (0, 2),
    num_position_embeddings: int = 64,
    mrope_section: tuple[int, int, int] = (4, 2, 2),
) -> Path:
    """Write config, random weights, tokenizer, generation, image- and video-processor configs into `out` (hub
    layout, as save_pretrained writes it).

    The ViT: 4 blocks of width 32 (2 heads), patch 16, merge 2, temporal patch 2, an 8x8 grid of learned position
    embeddings (num_position_embeddings 64: every test grid is resampled from it, up or down), DeepStack mergers
    after blocks 0 and 2; the LM: Qwen3, 4 layers of width 64 (out_hidden_size): each DeepStack level is added after
    its layer (0, 1) and reaches the text through the layers after it.
    `vision_std`: the ViT's and its mergers' weights' std, as LLaVA's builder does it: at the LM's std (1.0) the merged
    embeddings and DeepStack levels come out with std ~85, against the text embeddings' 1; at 0.2, ~3.5.
    `deepstack_gain`: the DeepStack mergers' outputs scaled up to the LM's hidden states where they are added (std
    ~500 after its first layer at init std 1.0): each level then moves the greedy tokens, so a test fails when one
    is dropped, misplaced or added twice (at ~3.5 none did).
    The shape arguments give other sizes (the benchmarks': `make bench-tier`'s Qwen3-VL beside its Qwen2-VL); the
    head size is the LM's width over its heads (`mrope_section` sums to half of it)."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]

    head_dim = hidden_size // num_heads
    text_config = dict(
        vocab_size=-(-len(tokenizer) // 64) * 64,  # padded to a multiple of 64 like real checkpoints
        hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim,  # NOTE: Qwen3's head_dim is its own field (default 128)
        max_position_embeddings=4096,
        # Qwen3-VL's interleaved M-RoPE: of head_dim/2 = 8 frequencies, h takes 1, 4 and w 2, 5 (mrope_section[1:]
        # each, every third from 1 and 2), t the rest: [4, 2, 2], as [24, 20, 20] is for the real head_dim 128.
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": list(mrope_section),
                         "mrope_interleaved": True},
        bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot,
    )  # fmt: skip
    vision_config = dict(
        depth=vision_depth, hidden_size=vision_hidden_size, intermediate_size=vision_mlp_ratio * vision_hidden_size,
        num_heads=vision_heads, hidden_act="gelu_pytorch_tanh", patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, num_position_embeddings=num_position_embeddings,
        deepstack_visual_indexes=list(deepstack_indexes), out_hidden_size=hidden_size,
    )  # fmt: skip
    config = Qwen3VLConfig(
        text_config=text_config, vision_config=vision_config, tie_word_embeddings=False,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    torch.manual_seed(seed)  # the constructor's own init is overwritten, but keep it reproducible too
    model = Qwen3VLForConditionalGeneration(config).eval()
    init_weights(model, seed, init_std)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual." in name and "norm" not in name:
                param.mul_(vision_std / init_std)
            if "deepstack_merger_list." in name and "linear_fc2" in name:
                param.mul_(deepstack_gain)
    save_qwen(model, tokenizer, ids, out)
    # As the hub's Qwen3-VL checkpoints write it (size{} in pixels; patch 16, so the resize factor is 32), with a
    # tiny pixel budget: 4 to 64 merged tokens an image.
    preprocessor = {
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": _HALF,
        "image_std": _HALF,
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
    }
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    # Video: one pixel budget for the whole sampled video (size{} over all frames, as Qwen3VLVideoProcessor reads
    # it): a 160x120 video sampled to 6 frames gets 128x96 frames, 12 tokens a tubelet.
    video = {**preprocessor, "size": {"shortest_edge": min_pixels, "longest_edge": video_pixels}, "fps": 2.0,
             "min_frames": 4, "max_frames": 64, "video_processor_type": "Qwen3VLVideoProcessor"}  # fmt: skip
    video.pop("image_processor_type")
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    return out


__all__ = ["build_qwen3_vl_checkpoint"]
