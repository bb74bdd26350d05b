"""Train a tiny Qwen2-VL from scratch on synthetic scenes (demo/scenes.py), on CPU, within a time budget."""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoImageProcessor,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

# NOTE: corpus and mrope_section come from build_tiny, so both checkpoints share one
# tokenizer recipe and one config recipe.
from demo.build_tiny import CHAT_TEMPLATE, QWEN2_SPLIT_PATTERN, SPECIAL_TOKENS, corpus, mrope_section
from demo.scenes import COLOURS, SHAPES, make_eval_set, make_scene, pair_questions

# Grounding and two pictures are the hard kinds: they get most of the samples.
KIND_WEIGHTS: dict[str, float] = {"colour": 0.14, "shape": 0.14, "count": 0.12, "grounding": 0.35, "which_image": 0.25}
MODEL_SIZES: dict[str, int] = dict(
    hidden_size=192, num_layers=3, num_heads=6, num_kv_heads=2, intermediate_size=512,
    vision_embed_dim=96, vision_depth=3, vision_heads=4, vision_mlp_ratio=2,
)  # fmt: skip
# At most 64 image tokens (256 patches of 14 px) per picture: a 336x336 scene is drawn at 224x224.
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 64
EVAL_SEED = 10_000  # the in-training check; demo/evaluate.py uses its own held-out seed


def scenes_corpus() -> list[str]:
    """The scenes' questions and answers, every colour, shape and digit, so each word is one token."""
    lines = []
    for colour in COLOURS:
        for shape in SHAPES:
            lines += [f"What colour is the {shape}?", colour, f"What shape is the {colour} one?",
                      f"What shape is the {colour} object?", shape, f"Where is the {colour} {shape}?",
                      f"the {colour} {shape}", f"Which picture has the {shape}?"]  # fmt: skip
    lines += ["How many shapes are there?", "The first picture.", "The second picture."]
    lines += ["system\nYou are a helpful assistant.", "user\n", "assistant\n"]  # the chat template's own words
    lines += [f"({d}{d},{d}0{d}),({d}{d}{d},{d})" for d in range(10)]
    return lines


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """build_tiny's byte-level BPE (Qwen2's split, special tokens last), trained on its corpus plus the scenes'."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )  # fmt: skip
    # The scenes' lines 20 times over, so their words win the merges of a small vocabulary.
    tok.train_from_iterator(corpus() + scenes_corpus() * 20, trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
        chat_template=CHAT_TEMPLATE, model_max_length=4096, clean_up_tokenization_spaces=False,
    )  # fmt: skip


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


def sample_conversation(rng: random.Random, max_turns: int = 4, num_objects: int | None = None) -> dict:
    """A training conversation: one scene (or two) and 1 to max_turns questions about it, each answer labelled.

    Several questions share one image encoding: per second of CPU, ~3x the answers of single questions. The
    first turn is exactly the served (single-question) format."""
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    if rng.choices(kinds, weights)[0] == "which_image":
        while True:
            scenes = [make_scene(rng, num_objects), make_scene(rng, num_objects)]
            options = [(q, a) for q, a, _ in pair_questions(*scenes)]
            if options:
                break
        rng.shuffle(options)
        return {"images": [sc.image for sc in scenes], "turns": options[: rng.randint(1, max_turns)],
                "objects": [sc.objects for sc in scenes]}  # fmt: skip
    scene = make_scene(rng, num_objects)
    options = scene.questions()
    used: set[int] = set()  # each shape is asked about once: a later question must not be answerable from an earlier one
    turns = []
    for _ in range(rng.randint(1, max_turns)):
        left = [o for o in options if o[3] is None or id(o[3]) not in used]
        if not left:
            break
        kind = rng.choices(sorted({o[0] for o in left}), [KIND_WEIGHTS[k] for k in sorted({o[0] for o in left})])[0]
        _, question, answer, obj = rng.choice([o for o in left if o[0] == kind])
        turns.append((question, answer))
        options = [o for o in options if o[1] != question]
        if obj is not None:
            used.add(id(obj))
    return {"images": [scene.image], "turns": turns, "objects": [scene.objects]}


class Encoder:
    """Conversations -> padded batches, with transformers' own Qwen2-VL pipeline: chat template, the image
    processor's pixel_values and grids, each <|image_pad|> expanded to its image's token count.

    An item is {"images", "turns": [(question, answer), ...]} or an eval item {"images", "question", "answer"}."""

    def __init__(self, checkpoint: Path, tokenizer: PreTrainedTokenizerFast, image_token_id: int):
        self.tokenizer, self.image_token_id = tokenizer, image_token_id
        self.processor = AutoImageProcessor.from_pretrained(checkpoint)
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def _ids(self, item: dict, with_answers: bool) -> tuple[list[int], list[int], list[int]]:
        """-> (token ids, labels (-100 but on answer tokens), index of the answer each label belongs to)."""
        turns = item.get("turns") or [(item["question"], item["answer"])]
        messages: list[dict] = []
        ids, labels, owner, rendered = [], [], [], ""
        for k, (question, answer) in enumerate(turns):
            content = [{"type": "image"} for _ in item["images"]] if k == 0 else []
            messages.append({"role": "user", "content": content + [{"type": "text", "text": question}]})
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            # The template renders each message on its own, so the text only grows: encode the new part.
            prompt = self.tokenizer.encode(text[len(rendered) :], add_special_tokens=False)
            ids += prompt
            labels += [-100] * len(prompt)
            owner += [-1] * len(prompt)
            if not with_answers:
                break
            target = self.tokenizer.encode(answer, add_special_tokens=False) + [self.im_end]
            ids += target
            labels += target
            owner += [k] * len(target)
            messages.append({"role": "assistant", "content": answer})
            rendered = text + answer + "<|im_end|>\n"
            newline = self.tokenizer.encode("\n", add_special_tokens=False)
            if k + 1 < len(turns):
                ids += newline
                labels += [-100] * len(newline)
                owner += [-1] * len(newline)
        return ids, labels, owner

    def __call__(self, items: list[dict], with_answers: bool = True) -> dict[str, torch.Tensor]:
        processed = self.processor(images=[im for it in items for im in it["images"]], return_tensors="pt")
        counts = iter((processed["image_grid_thw"].prod(-1) // self.processor.merge_size**2).tolist())
        rows, labels, weights = [], [], []
        for it in items:
            ids, labs, owner = self._ids(it, with_answers)
            expanded, exp_labels, exp_owner = [], [], []
            for tok, lab, own in zip(ids, labs, owner):
                n = next(counts) if tok == self.image_token_id else 1
                expanded += [tok] * n
                exp_labels += [lab] * n
                exp_owner += [own] * n
            rows.append(expanded)
            labels.append(exp_labels)
            # Each answer weighs the same, whatever its length: a colour (1 token) counts as much as a box (24).
            sizes = defaultdict(int)
            for own in exp_owner:
                sizes[own] += 1
            weights.append([1.0 / sizes[own] if own >= 0 else 0.0 for own in exp_owner])
        width = max(map(len, rows))
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])  # (B, T)
        batch = {
            "input_ids": input_ids,
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),  # (B, T)
            "mm_token_type_ids": (input_ids == self.image_token_id).int(),  # (B, T)
            "labels": torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels]),  # (B, T)
            "label_weights": torch.tensor([w + [0.0] * (width - len(w)) for w in weights]),  # (B, T)
            "pixel_values": processed["pixel_values"],  # (sum patches, 3*2*14*14)
            "image_grid_thw": processed["image_grid_thw"],  # (num_images, 3)
        }
        if all("objects" in it for it in items):
            batch["aux_targets"] = self.aux_targets(items, processed["image_grid_thw"])
        return batch

    def aux_targets(self, items: list[dict], grids: torch.Tensor) -> torch.Tensor:
        """Per image token, what the scene says is under its cell's centre: colour and shape ids (background
        last), the number of shapes, the cell's own centre and its shape's box (0..1, -1 on background).
        Rows in the merger's order: images in turn, cells row-major."""
        rows = []
        for (image, objects), (_, gh, gw) in zip([(im, ob) for it in items for im, ob in zip(it["images"], it["objects"])],
                                                 grids.tolist()):  # fmt: skip
            w, h = image.size
            mh, mw = gh // self.processor.merge_size, gw // self.processor.merge_size
            cy = (torch.arange(mh, dtype=torch.float32) + 0.5) / mh  # (mh,) 0..1
            cx = (torch.arange(mw, dtype=torch.float32) + 0.5) / mw  # (mw,)
            cy, cx = cy[:, None].expand(mh, mw).reshape(-1), cx[None, :].expand(mh, mw).reshape(-1)  # (mh*mw,)
            target = torch.full((mh * mw, 9), -1.0)
            target[:, 0], target[:, 1] = len(COLOURS), len(SHAPES)
            target[:, 2] = len(objects) - 1
            target[:, 3], target[:, 4] = cx, cy
            for obj in objects:
                x1, y1, x2, y2 = obj.box
                inside = (cx * w >= x1) & (cx * w < x2) & (cy * h >= y1) & (cy * h < y2)  # (mh*mw,)
                target[inside, 0] = list(COLOURS).index(obj.colour)
                target[inside, 1] = SHAPES.index(obj.shape)
                target[inside, 5:] = torch.tensor([x1 / w, y1 / h, x2 / w, y2 / h])
            rows.append(target)
        return torch.cat(rows)  # (sum tokens, 9)


def model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k not in ("labels", "label_weights", "aux_targets")}


class AuxHead(torch.nn.Module):
    """Training-only probe on the image tokens (the merger's output), never saved: per-token colour, shape, count,
    position and box. Dense labels teach the ViT in a few hundred steps what the answers alone take thousands
    of steps to reach, as the answer loss has to find the right image token and read it at once."""

    def __init__(self, hidden_size: int, visual: torch.nn.Module):
        super().__init__()
        self.proj = torch.nn.Linear(hidden_size, len(COLOURS) + 1 + len(SHAPES) + 1 + 3 + 2 + 4)
        self.image_embeds: torch.Tensor | None = None
        visual.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        self.image_embeds = output.pooler_output  # (sum tokens, hidden), before the model splits it per image

    def loss(self, targets: torch.Tensor) -> torch.Tensor:
        out = self.proj(self.image_embeds)  # (N, 27)
        nc, ns = len(COLOURS) + 1, len(SHAPES) + 1
        colour, shape, count = out[:, :nc], out[:, nc : nc + ns], out[:, nc + ns : nc + ns + 3]  # (N, 9), (N, 5), (N, 3)
        where, box = out[:, nc + ns + 3 : nc + ns + 5], out[:, nc + ns + 5 :]  # (N, 2), (N, 4)
        on_shape = targets[:, 5] >= 0  # (N,)
        loss = F.cross_entropy(colour, targets[:, 0].long()) + F.cross_entropy(shape, targets[:, 1].long())
        loss = loss + F.cross_entropy(count, targets[:, 2].long()) + 5 * F.l1_loss(where, targets[:, 3:5])
        if on_shape.any():
            loss = loss + 5 * F.l1_loss(box[on_shape], targets[on_shape, 5:])
        return loss


def answer_loss(model: Qwen2VLForConditionalGeneration, batch: dict) -> torch.Tensor:
    """Cross-entropy on the answer tokens, each answer's tokens averaged, then the mean over answers."""
    hidden = model.model(**model_inputs(batch)).last_hidden_state  # (B, T, hidden)
    targets = batch["labels"][:, 1:]  # (B, T-1): position t predicts token t+1
    weights = batch["label_weights"][:, 1:]  # (B, T-1)
    keep = targets != -100  # (B, T-1)
    logits = model.lm_head(hidden[:, :-1][keep])  # (N, vocab): the LM head runs on the answer positions alone
    losses = F.cross_entropy(logits, targets[keep], reduction="none")  # (N,)
    return (losses * weights[keep]).sum() / weights[keep].sum()


@torch.no_grad()
def teacher_forced_check(model, encoder: Encoder, items: list[dict]) -> dict[str, float]:
    """Per kind, the share of answers whose every token is the argmax given the right prefix (cheap, one forward)."""
    model.eval()
    right: dict[str, list[bool]] = defaultdict(list)
    for i in range(0, len(items), 16):
        chunk = items[i : i + 16]
        batch = encoder(chunk)
        logits = model.lm_head(model.model(**model_inputs(batch)).last_hidden_state[:, :-1])  # (B, T-1, vocab)
        targets = batch["labels"][:, 1:]  # (B, T-1)
        ok = (logits.argmax(-1) == targets) | (targets == -100)  # (B, T-1)
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
    """The same files as demo/build_tiny.py: config, weights, tokenizer + chat template, generation and image configs."""
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
    parser.add_argument("--steps", type=int, default=0, help="a fixed number of steps (the schedule follows "
                        "steps, not the clock); 0: as many as --minutes allows, the schedule following the clock")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=16, help="conversations per step")
    parser.add_argument("--max-turns", type=int, default=4, help="questions per training conversation, at most")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--single-until", type=float, default=0.3, help="share of training on one-shape scenes")
    parser.add_argument("--aux-weight", type=float, default=1.0, help="of the image tokens' probe loss (AuxHead)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="of the saved weights")
    parser.add_argument("--sizes", type=json.loads, default={}, help='overrides of MODEL_SIZES, as JSON')
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out = Path(args.out)
    sizes = {**MODEL_SIZES, **args.sizes}

    tokenizer = build_tokenizer()
    config = make_config(tokenizer, **sizes)
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
    aux = AuxHead(config.text_config.hidden_size, model.model.visual)
    named = list(model.named_parameters()) + list(aux.named_parameters())
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
        batch = encoder([sample_conversation(rng, args.max_turns, num_objects) for _ in range(args.batch_size)])
        loss = answer_loss(model, batch)
        aux_loss = aux.loss(batch["aux_targets"])
        loss_all = loss + args.aux_weight * aux_loss
        optim.zero_grad(set_to_none=True)
        loss_all.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        step += 1
        loss_ema = loss.item() if loss_ema is None else 0.98 * loss_ema + 0.02 * loss.item()
        if step % 20 == 0:
            print(f"step {step:5d}  {elapsed / 60:5.1f} min  lr {lr:.2e}  loss {loss.item():.3f}  ema {loss_ema:.3f}  aux {aux_loss.item():.3f}",
                  flush=True)  # fmt: skip
        if step % args.eval_every == 0:
            scores = teacher_forced_check(model, encoder, check_items)
            print("  teacher-forced exact: " + "  ".join(f"{k} {v:.2f}" for k, v in scores.items()), flush=True)

    wall = time.perf_counter() - start
    save_checkpoint(model, tokenizer, out, getattr(torch, args.dtype))
    scores = teacher_forced_check(model, encoder, check_items)
    print("final teacher-forced exact: " + "  ".join(f"{k} {v:.2f}" for k, v in scores.items()))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"trained {step} steps x {args.batch_size} in {wall / 60:.1f} min; wrote {out} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
