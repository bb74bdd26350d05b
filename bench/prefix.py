"""Second-turn time to first token with and without prefix reuse, or the embedding cache (`make bench-prefix`).

Each conversation: turn 1 = images + a long question, answered; turn 2 re-sends that whole history (same text,
same images) plus a short question, streamed, and its TTFT is measured. The app runs twice with the same
conversations one at a time: `--compare prefix` turns `enable_prefix_caching` on and off (bench checkpoint);
`--compare embedding-cache` turns the encoders' shared embedding cache on and off, prefix reuse on in both, on an
encoder-heavy checkpoint (a bigger ViT, 448x336 images) where re-encoding is most of a second turn's work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import torch

from bench.client import _one
from bench.server import CHECKPOINT_PARAMS, bench_checkpoint, serve_app
from bench.workload import data_url, noise_png

# Encoder-heavy: a ViT with about 6x the bench checkpoint's compute per patch, and images of 768 patches each.
ENCODER_HEAVY = {**CHECKPOINT_PARAMS, "vision_embed_dim": 256, "vision_depth": 8, "max_pixels": 448 * 448}
MODES = {  # name: (checkpoint, image size, the two settings compared: (label, overrides))
    "prefix": (
        CHECKPOINT_PARAMS,
        (224, 160),
        [("on", {"llm": {"enable_prefix_caching": True}}), ("off", {"llm": {"enable_prefix_caching": False}})],
    ),
    "embedding-cache": (
        ENCODER_HEAVY,
        (448, 336),
        [("on", {"encoder": {"cache_gib": 0.5}}), ("off", {"encoder": {"cache_gib": 0}})],
    ),
}


def conversations(n: int, images: int, words: int, seed: int, size=(224, 160)) -> list[list[dict]]:
    out = []
    for i in range(n):
        rng = np.random.default_rng(seed * 1000 + i)
        parts = [{"type": "image_url", "image_url": {"url": data_url(noise_png(*size, rng))}} for _ in range(images)]
        text = " ".join(f"word{(i * 7919 + k) % 997}" for k in range(words))
        out.append([{"role": "user", "content": [*parts, {"type": "text", "text": f"Question {i}: {text}"}]}])
    return out


async def second_turn_ttfts(url: str, convs: list[list[dict]], timeout: float) -> list[float]:
    ttfts = []
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        for conv in convs:
            first = await client.post(
                "/v1/chat/completions", json={"messages": conv, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
            )
            first.raise_for_status()
            history = conv + [
                {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And briefly?"},
            ]
            body = {
                "messages": history,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
                "return_token_ids": True,
            }
            result = await _one(client, 0, body, time.perf_counter(), timeout)
            if not result.ok:
                raise RuntimeError(f"second turn failed: {result.error}")
            ttfts.append(result.ttft)
    return ttfts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--compare", choices=sorted(MODES), default="prefix")
    p.add_argument("--images", type=int, default=2, help="noise images in turn 1")
    p.add_argument("--words", type=int, default=300, help="words of text in turn 1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench_results")
    args = p.parse_args(argv)
    params, size, settings = MODES[args.compare]
    ckpt = bench_checkpoint(Path(args.out_dir), params)
    convs = conversations(args.conversations, args.images, args.words, args.seed, size)
    results = {}
    for label, overrides in settings:
        with serve_app(ckpt, max_images=args.images, overrides=overrides) as url:
            warm = conversations(2, args.images, args.words, args.seed + 1, size)
            asyncio.run(second_turn_ttfts(url, warm, 300))
            results[label] = asyncio.run(second_turn_ttfts(url, convs, 300))
    on, off = (sorted(results[c]) for c in ("on", "off"))
    summary = {f"{name} p50_ms": round(statistics.median(v) * 1000, 1) for name, v in (("on", on), ("off", off))}
    summary |= {f"{name} mean_ms": round(statistics.mean(v) * 1000, 1) for name, v in (("on", on), ("off", off))}
    summary["speedup_p50"] = round(statistics.median(off) / statistics.median(on), 2)
    print(
        f"{datetime.now(UTC).isoformat(timespec='seconds')}  {platform.processor() or platform.machine()}  "
        f"torch {torch.__version__}; {args.conversations} conversations, {args.images} images {size[0]}x{size[1]} "
        f"+ {args.words} words"
    )
    print(
        f"second-turn TTFT p50: {args.compare} on {summary['on p50_ms']} ms, off {summary['off p50_ms']} ms "
        f"-> {summary['speedup_p50']}x"
    )
    out = Path(args.out_dir) / f"{args.compare}-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"args": vars(args), "summary": summary, "ttft_s": {"on": on, "off": off}}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
