"""Score a checkpoint on held-out scenes with transformers' greedy `generate`: accuracy per kind, mean IoU of boxes."""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

from demo.batches import Encoder, model_inputs
from demo.scenes import KINDS, iou, make_eval_set, parse_box

EVAL_SEED = 1234  # training draws from --seed (0); the in-training check from 10_000
# The bar: exact-match share for the answer kinds, mean IoU for grounding.
TARGETS: dict[str, float] = {"colour": 0.95, "shape": 0.95, "count": 0.95, "grounding": 0.6, "which_image": 0.9}
MAX_NEW_TOKENS = 32  # a grounding answer is 25 tokens with <|im_end|>


def score(item: dict, text: str) -> float:
    """1/0 for exact answers; IoU with the true box (0 when no box parses) for grounding."""
    if item["kind"] != "grounding":
        return float(text.strip() == item["answer"])
    parsed = parse_box(text)
    if parsed is None:
        return 0.0
    w, h = item["images"][0].size
    x1, y1, x2, y2 = parsed[1]
    return iou((x1 * w / 1000, y1 * h / 1000, x2 * w / 1000, y2 * h / 1000), item["box"])


@torch.no_grad()
def evaluate(checkpoint: str | Path, items: list[dict], batch_size: int = 8,
             verbose: bool = False) -> dict[str, tuple[float, int]]:  # fmt: skip
    """Per kind, (mean score of the greedy answers, number of questions); left-padded batches, as generate expects."""
    model = Qwen2VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    encoder = Encoder(Path(checkpoint), tokenizer, model.config.image_token_id)
    pad = tokenizer.pad_token_id
    scores: dict[str, list[float]] = defaultdict(list)
    for i in range(0, len(items), batch_size):
        chunk = items[i : i + batch_size]
        batch = encoder(chunk, with_answers=False)
        lengths = batch["attention_mask"].sum(-1).tolist()
        width = batch["input_ids"].shape[1]
        # Right-padded rows -> left-padded, so every row's generation starts at the same column.
        for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
            fill = pad if key == "input_ids" else 0
            rows = [
                torch.cat([torch.full((width - n,), fill, dtype=r.dtype), r[:n]]) for r, n in zip(batch[key], lengths)
            ]
            batch[key] = torch.stack(rows)  # (B, T)
        batch = model_inputs(batch)
        out = model.generate(**batch, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)  # (B, T + new)
        for item, row in zip(chunk, out[:, width:]):
            text = tokenizer.decode(row, skip_special_tokens=False).split("<|im_end|>")[0]
            scores[item["kind"]].append(score(item, text))
            if verbose:
                print(f"{item['kind']:12s} {item['question']!r:40s} -> {text!r}  (want {item['answer']!r})")
    return {k: (sum(scores[k]) / len(scores[k]), len(scores[k])) for k in KINDS if scores[k]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoint", nargs="?", default="demo/qwen2-vl-shapes")
    parser.add_argument("--seed", type=int, default=EVAL_SEED)
    parser.add_argument("-n", type=int, default=200, help="questions, the kinds in turn")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("-v", "--verbose", action="store_true", help="print every answer")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    results = evaluate(args.checkpoint, make_eval_set(args.seed, args.n), verbose=args.verbose)
    print(f"{args.checkpoint}, {args.n} held-out questions (seed {args.seed}), {time.perf_counter() - start:.0f} s")
    print("| kind | n | score | target |\n| --- | --- | --- | --- |")
    ok = True
    for kind, (value, n) in results.items():
        metric = "mean IoU" if kind == "grounding" else "exact"
        passed = value >= TARGETS[kind]
        ok &= passed
        print(f"| {kind} | {n} | {value:.3f} ({metric}) | {TARGETS[kind]} {'ok' if passed else 'MISSED'} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
