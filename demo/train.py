"""Train a tiny Qwen2-VL from scratch on synthetic scenes (demo/scenes.py), on CPU, within a time budget."""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from demo.batches import Encoder, model_inputs, sample_conversation

# NOTE: corpus and mrope_section come from build_tiny, so both checkpoints share one
# tokenizer recipe and one config recipe.
from demo.build_tiny import QWEN2_SPLIT_PATTERN, SPECIAL_TOKENS, corpus, mrope_section
from demo.build_tiny import build_tokenizer as build_tiny_tokenizer
from demo.scenes import COLOURS, SHAPES, make_eval_set
from demo.supervision import Probes

MODEL_SIZES: dict[str, int] = dict(
    hidden_size=192, num_layers=3, num_heads=6, num_kv_heads=2, intermediate_size=512,
    vision_embed_dim=96, vision_depth=3, vision_heads=4, vision_mlp_ratio=2,
)  # fmt: skip
# At most 36 image tokens (144 patches of 14 px) per picture: a 336x336 scene is seen at 168x168. Fewer patches
# make a step cheaper, and each 14 px patch holds more of a shape's outline.
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 36
EVAL_SEED = 10_000  # the in-training check; demo/evaluate.py uses its own held-out seed


# Coordinates are written in steps of COORD_STEP (0, 10, ..., 990): each is one token of this tokenizer (digits
# split in runs of up to three, not one by one as Qwen2's pattern does), so a box is four 100-way choices, not
# twelve digits. Rounding to 10 of 1000 moves an edge by at most 0.5% of the picture.
COORD_STEP = 10
COORDS: list[str] = [str(v) for v in range(0, 1000, COORD_STEP)]
DEMO_SPLIT_PATTERN = QWEN2_SPLIT_PATTERN.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def scenes_corpus() -> list[str]:
    """The scenes' questions and answers, every colour, shape and coordinate, so each word is one token."""
    lines = []
    for colour in COLOURS:
        for shape in SHAPES:
            lines += [f"What colour is the {shape}?", colour, f"What shape is the {colour} one?",
                      f"What shape is the {colour} object?", shape, f"Where is the {colour} {shape}?",
                      f"the {colour} {shape}", f"Which picture has the {shape}?"]  # fmt: skip
    lines += ["How many shapes are there?", "The first picture.", "The second picture."]
    lines += ["system\nYou are a helpful assistant.", "user\n", "assistant\n"]  # the chat template's own words
    lines += [f"({a},{b}),({b},{a})" for a, b in zip(COORDS, reversed(COORDS))]
    return lines


def quantize_box(answer: str) -> str:
    """A grounding answer with its coordinates rounded to COORD_STEP (at most 990)."""
    step = lambda m: str(min(990, round(int(m.group()) / COORD_STEP) * COORD_STEP))  # noqa: E731
    return re.sub(r"\d+", step, answer) if answer.startswith("<|object_ref_start|>") else answer


def build_tokenizer(vocab_size: int = 768) -> PreTrainedTokenizerFast:
    """build_tiny's byte-level BPE with digits in runs of three, trained on its corpus plus the scenes' lines 20
    times over (so their words win the merges of a small vocabulary). Every coordinate is checked to be one token."""
    tokenizer = build_tiny_tokenizer(vocab_size, DEMO_SPLIT_PATTERN, corpus() + scenes_corpus() * 20)
    split = [c for c in COORDS if len(tokenizer.encode(c, add_special_tokens=False)) != 1]
    if split:
        raise RuntimeError(f"coordinates {split[:5]} are not single tokens: raise vocab_size")
    return tokenizer


def make_config(tokenizer: PreTrainedTokenizerFast, *, hidden_size: int, num_layers: int, num_heads: int,
                num_kv_heads: int, intermediate_size: int, vision_embed_dim: int, vision_depth: int,
                vision_heads: int, vision_mlp_ratio: int) -> Qwen2VLConfig:  # fmt: skip
    """Qwen2-VL config as demo/build_tiny.py writes it, at the given sizes."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    text_config = dict(
        vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_window_layers=num_layers, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": mrope_section(hidden_size // num_heads)},
        bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot,
    )  # fmt: skip
    vision_config = dict(
        depth=vision_depth, embed_dim=vision_embed_dim, num_heads=vision_heads, mlp_ratio=vision_mlp_ratio,
        hidden_size=hidden_size, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
    )  # fmt: skip
    return Qwen2VLConfig(
        text_config=text_config, vision_config=vision_config, tie_word_embeddings=False,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip


class AnswerLoss:
    """Cross-entropy on the answer tokens, each answer's tokens averaged, then the mean over answers. A coordinate's
    target is soft: a Gaussian of COORD_SIGMA steps around the true value over the coordinate tokens, so that
    250 for 260 costs less than 900 for 260."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, vocab_size: int, sigma: float = 1.0):
        self.coord_ids = torch.tensor(tokenizer.convert_tokens_to_ids(COORDS))  # (C,)
        self.coord_of = torch.full((vocab_size,), -1)
        self.coord_of[self.coord_ids] = torch.arange(len(COORDS))
        bins = torch.arange(len(COORDS), dtype=torch.float32)
        soft = torch.exp(-((bins[:, None] - bins[None, :]) ** 2) / (2 * sigma**2))  # (C, C)
        self.soft = soft / soft.sum(-1, keepdim=True)

    def __call__(self, model: Qwen2VLForConditionalGeneration, batch: dict) -> torch.Tensor:
        hidden = model.model(**model_inputs(batch)).last_hidden_state  # (B, T, hidden)
        targets = batch["labels"][:, 1:]  # (B, T-1): position t predicts token t+1
        weights = batch["label_weights"][:, 1:]  # (B, T-1)
        keep = targets != -100  # (B, T-1)
        logits = model.lm_head(hidden[:, :-1][keep])  # (N, vocab): the LM head runs on the answer positions alone
        return (self.token_losses(logits, targets[keep]) * weights[keep]).sum() / weights[keep].sum()

    def token_losses(self, logits: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        """logits (N, vocab), wanted (N,) -> (N,) cross-entropies, soft on coordinates."""
        hard = F.cross_entropy(logits, wanted, reduction="none")  # (N,)
        coord = self.coord_of[wanted]  # (N,) -1 but on coordinates
        soft = -(self.soft[coord.clamp_min(0)] * logits.log_softmax(-1)[:, self.coord_ids]).sum(-1)  # (N,)
        return torch.where(coord >= 0, soft, hard)


@torch.no_grad()
def teacher_forced_check(model, encoder: Encoder, items: list[dict], coord_of: torch.Tensor) -> dict[str, float]:
    """Per kind, the share of answers whose every token is the argmax given the right prefix (cheap, one forward);
    a box counts when its coordinates are within one step."""
    model.eval()
    right: dict[str, list[bool]] = defaultdict(list)
    for i in range(0, len(items), 16):
        chunk = [{**it, "answer": quantize_box(it["answer"])} for it in items[i : i + 16]]
        batch = encoder(chunk)
        logits = model.lm_head(model.model(**model_inputs(batch)).last_hidden_state[:, :-1])  # (B, T-1, vocab)
        targets = batch["labels"][:, 1:]  # (B, T-1)
        got = logits.argmax(-1)  # (B, T-1)
        want_c, got_c = coord_of[targets.clamp_min(0)], coord_of[got]  # (B, T-1) -1 but on coordinates
        ok = (got == targets) | (targets == -100) | ((want_c >= 0) & (got_c >= 0) & ((want_c - got_c).abs() <= 1))
        for it, row in zip(chunk, ok.all(-1).tolist()):
            right[it["kind"]].append(row)
    model.train()
    return {k: sum(v) / len(v) for k, v in sorted(right.items())}


def lr_at(progress: float, peak: float, warmup: float = 0.05, floor: float = 0.05) -> float:
    """Linear warmup, then cosine down to floor*peak, over progress in [0, 1]."""
    if progress < warmup:
        return peak * progress / warmup
    p = min(1.0, (progress - warmup) / (1 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def save_checkpoint(model, tokenizer, out: Path, dtype: torch.dtype) -> None:
    """The same files as demo/build_tiny.py: config, weights, tokenizer + chat template, generation and image
    configs."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out)
    model.to(torch.float32)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="demo/qwen2-vl-shapes", help="checkpoint directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=20.0, help="wall-clock budget of the training loop")
    parser.add_argument("--steps", type=int, default=0, help="a fixed number of steps (the schedule follows steps, "
                        "not the clock); 0: as many as --minutes allows, the schedule following the clock")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=16, help="conversations per step")
    parser.add_argument("--max-turns", type=int, default=4, help="questions per training conversation, at most")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--single-until", type=float, default=0.0, help="share of training on one-shape scenes")
    parser.add_argument("--vision-until", type=float, default=0.15, help="share of training of the vision tower "
                        "alone, on its probe (a step costs half of a whole model's)")  # fmt: skip
    parser.add_argument("--vision-weight", type=float, default=1.0, help="of the image tokens' probe loss")
    parser.add_argument("--route-weight", type=float, default=0.5, help="of the routed attention head's loss")
    parser.add_argument(
        "--ask-weight", type=float, default=0.5, help="of the first layer's head on the question's words"
    )
    parser.add_argument("--read-weight", type=float, default=0.5, help="of the routed layer's answer probe")
    parser.add_argument("--picture-weight", type=float, default=0.5, help="of the picture-index probe's loss")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="of the saved weights")
    parser.add_argument("--sizes", type=json.loads, default={}, help="overrides of MODEL_SIZES, as JSON")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out = Path(args.out)
    sizes = {**MODEL_SIZES, **args.sizes}

    tokenizer = build_tokenizer()
    config = make_config(tokenizer, **sizes)
    config.text_config._attn_implementation = "eager"  # the routed head's weights; not saved in config.json
    model = Qwen2VLForConditionalGeneration(config)  # transformers' own init (std 0.02)
    model.generation_config = GenerationConfig(
        eos_token_id=[config.text_config.eos_token_id, config.text_config.pad_token_id],
        pad_token_id=config.text_config.pad_token_id, bos_token_id=config.text_config.bos_token_id, do_sample=False,
    )  # fmt: skip
    # Write the tokenizer and image processor first: the training pipeline loads the processor from the checkpoint.
    save_checkpoint(model, tokenizer, out, torch.float32)
    encoder = Encoder(out, tokenizer, config.image_token_id)
    n_params = sum(p.numel() for p in model.parameters())
    n_vision = sum(p.numel() for p in model.model.visual.parameters())
    print(f"{n_params:,} parameters ({n_vision:,} vision), vocab {len(tokenizer)}, sizes {sizes}", flush=True)

    check_items = make_eval_set(EVAL_SEED, 60)
    probes = Probes(model)
    answer_loss = AnswerLoss(tokenizer, config.text_config.vocab_size)
    named = list(model.named_parameters()) + list(probes.named_parameters())
    params = [p for _, p in named]
    decay = [p for n, p in named if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in named if not (p.ndim >= 2 and "embed" not in n)]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=args.lr, betas=(0.9, 0.98), eps=1e-8)  # fmt: skip
    budget = args.minutes * 60
    model.train()
    start = time.perf_counter()
    step, loss_ema = 0, None
    while True:
        elapsed = time.perf_counter() - start
        progress = step / args.steps if args.steps else elapsed / budget
        if progress >= 1.0 or elapsed >= budget:
            break
        lr = lr_at(progress, args.lr)
        for group in optim.param_groups:
            group["lr"] = lr
        # Curriculum: one shape per picture first, so "look at the shape" is learnt before "look at the right one".
        num_objects = 1 if progress < args.single_until else None
        batch = encoder([sample_conversation(rng, args.max_turns, num_objects, quantize_box)
                         for _ in range(args.batch_size)])  # fmt: skip
        if progress < args.vision_until:  # the tower learns to see before the LM learns to ask
            model.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"])
            aux = {"vision": probes.vision_loss(batch["vision_targets"])}
            loss = torch.zeros(())
        else:
            loss = answer_loss(model, batch)
            aux = {"vision": probes.vision_loss(batch["vision_targets"]),
                   "route": probes.route_loss(batch["route_queries"], batch["route_keys"]),
                   "ask": probes.route_loss(batch["ask_queries"], batch["ask_keys"], layer=0),
                   "read": probes.read_loss(batch["read_queries"], batch["read_colours"], batch["read_shapes"],
                                            batch["read_boxes"]),
                   "picture": probes.picture_loss(batch["pictures"])}  # fmt: skip
        loss_all = loss + sum(getattr(args, f"{k}_weight") * v for k, v in aux.items())
        optim.zero_grad(set_to_none=True)
        loss_all.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        step += 1
        if progress >= args.vision_until:
            loss_ema = loss.item() if loss_ema is None else 0.98 * loss_ema + 0.02 * loss.item()
        if step % 20 == 0:
            probed = "  ".join(f"{k} {v.item():.3f}" for k, v in aux.items())
            probed += f"  token shapes {probes.seen['shape_accuracy'].item():.2f}"
            losses = f"loss {loss.item():.3f}  ema {loss_ema or 0:.3f}"
            print(f"step {step:5d}  {elapsed / 60:5.1f} min  lr {lr:.2e}  {losses}  {probed}",
                  flush=True)  # fmt: skip
        if step % args.eval_every == 0 and progress >= args.vision_until:
            scores = teacher_forced_check(model, encoder, check_items, answer_loss.coord_of)
            print("  teacher-forced exact: " + "  ".join(f"{k} {v:.2f}" for k, v in scores.items()), flush=True)

    wall = time.perf_counter() - start
    save_checkpoint(model, tokenizer, out, getattr(torch, args.dtype))
    scores = teacher_forced_check(model, encoder, check_items, answer_loss.coord_of)
    print("final teacher-forced exact: " + "  ".join(f"{k} {v:.2f}" for k, v in scores.items()))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"trained {step} steps x {args.batch_size} in {wall / 60:.1f} min; wrote {out} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
