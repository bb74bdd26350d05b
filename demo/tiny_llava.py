"""Build a tiny, deterministic, random-weight LLaVA-1.5 checkpoint (CLIP tower, two-layer projector, Llama LM)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from demo.build_tiny import build_tokenizer, init_weights

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# llava-hf/llava-1.5-*-hf's chat template: "USER: <image>\n{text} ASSISTANT:", a message's images before its text,
# one `<image>` per image (the server expands it to the image's tokens). Its `{% generation %}` markers (for
# assistant masks in training) are left out; string contents are rendered too (llava-hf's template drops them).
CHAT_TEMPLATE: str = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}"
    "{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
    "{% endfor %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# llava-hf/llava-1.5-7b-hf's own chat template, verbatim: it renders typed parts only, so a string content goes
# missing unless the server sends it as a text part (deployments/ingress/prompt.py: needs_typed_content).
LLAVA_HF_CHAT_TEMPLATE: str = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<image>"]

_HUB_PREFIXES = ("vision_tower.", "multi_modal_projector.", "language_model.model.", "language_model.lm_head.")
# Safetensors key renames from what transformers 5's save_pretrained writes ("hub") to the other layouts.
_LAYOUTS: dict[str, tuple[tuple[str, str], ...]] = {
    "hub": (),
    # llava-hf checkpoints made with transformers 4.x: the CLIP tower keeps its `vision_model.` level.
    "legacy": (("vision_tower.", "vision_tower.vision_model."),),
    # What transformers 4.52-4.57 saved: the module paths of the model.
    "prefixed": (
        ("vision_tower.", "model.vision_tower.vision_model."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
    ),
}


def build_llava_tokenizer() -> PreTrainedTokenizerFast:
    """build_tiny's byte-level BPE with Llama's specials: `<s>` prepended to every encoding (as Llama's tokenizer
    does with add_special_tokens), `</s>` ends a turn, `<image>` is the image placeholder."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tok = build_tokenizer().backend_tokenizer  # NOTE: keeps build_tiny's Qwen specials too; they are never used
    tok.add_special_tokens(SPECIAL_TOKENS)
    bos = tok.token_to_id("<s>")
    tok.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", chat_template=CHAT_TEMPLATE,
        model_max_length=4096, clean_up_tokenization_spaces=False,
    )  # fmt: skip


def _rename(weights_path: Path, layout: str) -> None:
    from safetensors.torch import load_file, save_file

    renamed = {}
    for key, value in load_file(str(weights_path)).items():
        assert key.startswith(_HUB_PREFIXES), f"save_pretrained wrote {key!r}, not a hub layout key"
        for old, new in _LAYOUTS[layout]:
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        renamed[key] = value
    save_file(renamed, str(weights_path), metadata={"format": "pt"})


def build_llava_checkpoint(
    out: str | Path, seed: int = 0, layout: str = "hub", image_size: int = 56, patch_size: int = 14,
    select_strategy: str = "default", feature_layer: int | list[int] = -2, *, do_pad: bool = False,
    init_std: float = 1.0, vision_std: float = 0.2, chat_template: str = CHAT_TEMPLATE,
) -> Path:  # fmt: skip
    """Write config, random weights, tokenizer, chat template, processor and generation configs into `out`.

    CLIP vision: hidden 32, 2 layers, image_size/patch_size per side (56/14: 16 patches); Llama: hidden 64, 2 layers.
    `layout`: "hub" (what transformers 5 writes), "legacy" (llava-hf 4.x names) or "prefixed" (4.52-4.57).
    `chat_template`: LLAVA_HF_CHAT_TEMPLATE for llava-hf's own."""
    import torch
    from transformers import GenerationConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(_LAYOUTS)}, got {layout!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_llava_tokenizer()
    tokenizer.chat_template = chat_template
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    num_patches = (image_size // patch_size) ** 2
    text_config = dict(
        model_type="llama", vocab_size=-(-len(tokenizer) // 64) * 64,  # padded to a multiple of 64
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"],
    )  # fmt: skip
    vision_config = dict(
        model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, image_size=image_size, patch_size=patch_size, projection_dim=32,
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=vision_config, text_config=text_config, image_token_id=ids["<image>"],
        vision_feature_layer=feature_layer, vision_feature_select_strategy=select_strategy,
        image_seq_length=num_patches + (select_strategy == "full"), pad_token_id=ids["<pad>"],
    )  # fmt: skip
    torch.manual_seed(seed)  # the constructor's own init is overwritten, but keep it reproducible too
    model = LlavaForConditionalGeneration(config).eval()
    init_weights(model, seed, init_std)
    with torch.no_grad():
        # NOTE: the CLIP residual stream is not normalized before the projector (hidden_states[-2]), so the
        # LM's std would make image embeddings ~1000x the text ones; a smaller one keeps them comparable.
        for name, param in model.named_parameters():
            if ("vision_tower" in name or "multi_modal_projector" in name) and "norm" not in name:
                param.mul_(vision_std / init_std)
        # Zero output rows get logit 0, far below the random winners, so greedy decoding never emits them: the
        # ids past the tokenizer (padding of the matrix), the placeholder, `<s>` and `<pad>`.
        never = [ids["<image>"], ids["<s>"], ids["<pad>"], *range(len(tokenizer), config.text_config.vocab_size)]
        model.lm_head.weight[never] = 0.0
    model.generation_config = GenerationConfig(
        eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"], bos_token_id=ids["<s>"], do_sample=False
    )
    model.save_pretrained(out)
    image_processor = LlavaImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}, do_pad=do_pad
    )
    # The processor's own expansion of `<image>` must give the model's count: CLIP's CLS is one more token,
    # dropped again by the "default" strategy (as llava-hf's processor_config.json says).
    LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy=select_strategy,
        num_additional_image_tokens=1,
        chat_template=chat_template,
    ).save_pretrained(out)
    # NOTE: transformers 5 nests the image processor in processor_config.json; llava-hf checkpoints (and the
    # encoder replicas' readers) also have it alone in preprocessor_config.json.
    image_processor.save_pretrained(out)
    if layout != "hub":
        _rename(out / "model.safetensors", layout)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="demo/llava-tiny", help="checkpoint directory")
    parser.add_argument("--layout", choices=sorted(_LAYOUTS), default="hub", help="safetensors key layout")
    args = parser.parse_args(argv)
    print(build_llava_checkpoint(args.out, layout=args.layout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
