"""Build a tiny, deterministic, random-weight Qwen2-VL checkpoint with a locally trained tokenizer."""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

# torch/transformers are imported inside the functions: `make serve` runs this module on every
# start, and the "already up to date" answer should not pay seconds of heavy imports.
if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS: list[str] = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip

# Qwen2-VL's chat format, written from its documented behaviour. Plain string pieces (no Jinja
# whitespace control) so every newline in the output is visible here. Exactly one <|image_pad|>
# per image: the server expands it to the real number of vision tokens once the grid is known.
CHAT_TEMPLATE: str = (
    "{% set counts = namespace(image=0, video=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{% set counts.image = counts.image + 1 %}"
    "{% if add_vision_id %}Picture {{ counts.image }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "{% set counts.video = counts.video + 1 %}"
    "{% if add_vision_id %}Video {{ counts.video }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Same split rule as Qwen2's tokenizer: contractions, letter runs (with one leading non-letter),
# single digits, punctuation runs, newlines, and whitespace that leaves one space for the next word.
QWEN2_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_CHAT_LINES = """\
Hello! How can I help you today? Hi there, I am a helpful assistant and I can describe images.
What is in this picture? It shows a red circle on the left and a blue square on the right.
Describe the image in one sentence, please. Sure, here is a short description of the image.
How many shapes are there? There are 3 shapes: 2 circles and 1 triangle. What colour is the star?
Is the green square in the center? Yes, it is in the middle, just above a thin black line.
Count the dots from left to right: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10. The box is at (12,34), (56,78).
Thank you! You're welcome. Let me know if you have any other questions, I'd be happy to help.
I'm not sure, but it looks like a small orange triangle near the bottom. Answer with one word: blue.
Compare the two pictures. Both have a circle, but the colours and sizes are different.
The first image is bright and clear, while the second one is dark, blurry and quite noisy.
What time is it? It is 10:30 in the morning, and the weather is warm, sunny and nice today.
Why is the sky blue? Light from the sun is scattered by the air, and blue light scatters most.
Write a list: first, second, third, fourth, fifth; then stop. OK, done. Anything else?
Good morning, good evening, good night. See you later! Goodbye, and have a wonderful day.
A cat is sleeping on a soft chair next to the window, and a dog is playing in the garden.
The photo was taken outside: there are tall trees, a small house, a road, cars and people walking.
Please explain your reasoning step by step, then give the final answer in a short sentence.
The text in the image says "open" in large letters; below it, smaller words are hard to read.
This chart has four bars. The highest bar is green, the lowest is purple, and the title is missing.
Could you translate this into simple words? Of course. It means that the door should stay closed.
I cannot see any faces or animals. The picture only contains lines, colours and simple patterns.
Big, small, large, tiny, long, short, wide, narrow, heavy, light, empty, full, old, new, hot, cold.
Above, below, inside, outside, between, behind, in front of, near, far, next to, across, around.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday; January, March, June, October.
We think the answer is correct, although the question was a little unclear and somewhat tricky.
Water, food, book, table, phone, computer, music, river, mountain, city, school, friend, family.
Fruit: apple, banana, cherry, grape, lemon, mango, peach and a slice of watermelon on a plate.
Animals: horse, bird, fish, mouse, rabbit, lion, tiger, bear, sheep, cow, duck, frog, snake, bee.
Do you like it? Yes, I really like it because it looks beautiful, calm, funny and interesting.
Numbers like 100, 2024 and 3.14 are written with digits; words like hundred and thousand are not.
"""
_COLOURS = ["red", "green", "blue", "yellow", "orange", "purple", "white", "black", "gray", "pink", "brown"]
_SHAPES = ["circle", "square", "triangle", "star", "rectangle", "line", "dot", "heart"]
_PLACES = ["left", "right", "top", "bottom", "center", "top left corner", "bottom right corner"]
_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def corpus() -> list[str]:
    """A fixed few-KB English corpus: hand-written chat lines plus templated image Q&A."""
    lines = _CHAT_LINES.splitlines()
    # Walk the combinations in a fixed order so the corpus (and so the merges) never change.
    for i, (colour, shape) in enumerate(itertools.product(_COLOURS, _SHAPES)):
        place = _PLACES[i % len(_PLACES)]
        n = i % len(_NUMBERS)
        lines.append(f"There is a {colour} {shape} at the {place} of the image.")
        lines.append(f"How many {shape}s are {colour}? I can see {_NUMBERS[n]} ({n}) {colour} {shape}s.")
    return lines


def build_tokenizer(
    vocab_size: int = 1024, split_pattern: str | None = None, lines: list[str] | None = None
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE like Qwen2's on the embedded corpus (or `lines`); special tokens get the last ids.
    `split_pattern`: the pre-tokenizer's regex, Qwen2's by default."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split_pattern or QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    # The full 256-byte alphabet makes any UTF-8 text (emoji, CJK) encodable, just as byte tokens.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )  # fmt: skip
    tok.train_from_iterator(corpus() if lines is None else lines, trainer=trainer)
    # Added after training, so their ids follow the BPE vocab; special => never split, never merged.
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
        chat_template=CHAT_TEMPLATE, model_max_length=4096, clean_up_tokenization_spaces=False,
    )  # fmt: skip


def mrope_section(head_dim: int) -> list[int]:
    """Split head_dim/2 rotary pairs over (t, h, w) in Qwen2-VL's 16:24:24 proportions."""
    half = head_dim // 2
    t = max(1, half // 4)
    h = (half - t) // 2
    return [t, h, half - t - h]


def init_weights(model: torch.nn.Module, seed: int, std: float) -> None:
    """Redraw every parameter from one seeded generator, in name order, so the bytes are reproducible.

    With the usual 0.02 the logits are nearly flat and greedy decoding flips on float noise. The
    default std 1.0 (logit std ~8) was tuned with seed 0: over 24 greedy tokens for text-only,
    one-image and two-image prompts every top-1/top-2 gap is > 0.04 (> 0.015 with tied embeddings
    or hidden_size 128). Gaps shrink over longer generations (a minimum over random draws), and
    much larger stds only inflate activations (the MLPs grow them like std**3).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name or "ln_q" in name:  # RMSNorm / LayerNorm: identity scale, no shift
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def to_legacy_layout(weights_path: Path) -> None:
    """Rename keys to the layout transformers 4.52-4.57 saved (model.visual.*, model.language_model.*)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights_path))
    renamed: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if key.startswith("visual."):
            key = "model." + key
        elif key.startswith("model."):
            key = "model.language_model." + key[len("model.") :]
        renamed[key] = value
    save_file(renamed, str(weights_path), metadata={"format": "pt"})


def build_checkpoint(
    out_dir: str | Path, *, seed: int = 0, init_std: float = 1.0, layout: str = "hub",
    hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
    intermediate_size: int = 128, vision_embed_dim: int = 32, vision_depth: int = 2, vision_heads: int = 2,
    vision_mlp_ratio: int = 2,
    min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 256, tie_word_embeddings: bool = False,
) -> Path:  # fmt: skip
    """Write config, random weights, tokenizer, generation and image-processor configs into out_dir."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if layout not in ("hub", "legacy"):
        raise ValueError(f"layout must be 'hub' or 'legacy', got {layout!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]

    head_dim = hidden_size // num_heads
    text_config = dict(
        vocab_size=-(-len(tokenizer) // 64) * 64,  # padded to a multiple of 64 like real checkpoints
        hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, max_window_layers=num_layers,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section(head_dim)},
        bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot,  # Qwen's configs name <|endoftext|> bos too
    )  # fmt: skip
    vision_config = dict(
        depth=vision_depth, embed_dim=vision_embed_dim, num_heads=vision_heads, mlp_ratio=vision_mlp_ratio,
        hidden_size=hidden_size,  # the merger projects merged patches into the LM's width
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
    )  # fmt: skip
    config = Qwen2VLConfig(
        text_config=text_config, vision_config=vision_config, tie_word_embeddings=tie_word_embeddings,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    torch.manual_seed(seed)  # the constructor's own init is overwritten, but keep it reproducible too
    model = Qwen2VLForConditionalGeneration(config).eval()
    init_weights(model, seed, init_std)
    save_qwen(model, tokenizer, ids, out)
    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels).save_pretrained(out)
    if layout == "legacy":
        to_legacy_layout(out / "model.safetensors")
    return out


def save_qwen(model, tokenizer, ids: dict[str, int], out: Path) -> None:
    """A tiny Qwen-VL model's last steps (Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's builders): output rows greedy decoding
    must never pick zeroed, the generation config, the weights and the tokenizer saved in `out`."""
    import torch
    from transformers import GenerationConfig

    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    with torch.no_grad():
        # Zero output rows get logit 0, far below the random winners, so greedy decoding never emits
        # them: the ids past the tokenizer (they only pad the matrix to a multiple of 64) and the
        # vision placeholders, which a real model never generates and a server must not re-expand.
        never = [i for t, i in ids.items() if t.startswith("<|vision") or t.endswith("_pad|>")]
        never += range(len(tokenizer), model.config.text_config.vocab_size)
        model.lm_head.weight[never] = 0.0
    model.generation_config = GenerationConfig(
        eos_token_id=[im_end, eot], pad_token_id=eot, bos_token_id=eot, do_sample=False
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)  # also writes chat_template.jinja, where processor loaders look


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="demo/qwen2-vl-tiny", help="checkpoint directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if the checkpoint exists")
    parser.add_argument("--layout", choices=["hub", "legacy"], default="hub", help="safetensors key layout")
    args = parser.parse_args(argv)

    out = Path(args.out)
    if not args.force and all((out / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")):
        print(f"{out} is up to date (use --force to rebuild)")
        return 0

    start = time.perf_counter()
    from safetensors.torch import load_file
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep `make serve` output to one line
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename at the end: a half-written checkpoint never looks complete.
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        build_checkpoint(staging, layout=args.layout)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)

    n_params = sum(t.numel() for t in load_file(str(out / "model.safetensors")).values())
    print(f"wrote {out} ({n_params:,} parameters, {args.layout} layout) in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
