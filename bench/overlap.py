"""`make bench-overlap`: time to first token of 4-image requests with prefill overlapped with encoding, and without.

Two apps in one Ray cluster, the same but for `llm.overlap_encoding`, each with one Encoder replica that encodes one
image per forward (`encoder.max_batch_patches` = one image's patches), so a request's images are ready one after
another; the LLM then prefills the text and each image as it arrives (on), or everything once the last is encoded
(off). Requests alternate between the two apps, one at a time: 4 new 448x448 images (no cache hits) and `--words`
words of text before them, `max_tokens` 1. The ViT is the bench checkpoint's, optionally slowed by bench/slow_vit.py
to `--image-s` seconds an image (a larger tower). Prints a table and, last, `overlap: TTFT p50 of 4-image requests
on/off = Rx`."""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.server import CHECKPOINT_PARAMS, QUIET, bench_checkpoint, ray_serve, wait_healthy
from bench.slow_vit import SlowViT
from demo.inputs import data_url, make_image
from encoders import ModelSpec

SIDE = 448
CHECKPOINT = {**CHECKPOINT_PARAMS, "max_pixels": SIDE * SIDE}  # 256 tokens an image


def deploy(name: str, checkpoint: Path, overlap: bool, seconds_per_gflop: float) -> None:
    from ray import serve

    from deployments.encoder.server import Encoder
    from deployments.ingress import Ingress
    from deployments.llm.server import LLM

    patches = (SIDE // 14) ** 2
    args = {
        "model": str(checkpoint),
        "llm": {"max_model_len": 4096, "overlap_encoding": overlap},
        "encoder": {"cache_gib": 0, "max_batch_patches": patches, "max_batch_wait_ms": 0},
        "limits": {"max_images_per_request": 8},
    }
    factory = functools.partial(SlowViT, seconds_per_gflop=seconds_per_gflop)
    encoder = Encoder.options(autoscaling_config=None, num_replicas=1, ray_actor_options={"num_cpus": 0.5})
    llm = LLM.options(ray_actor_options={"num_cpus": 1})
    app = Ingress.options(ray_actor_options={"num_cpus": 0.25}).bind(
        encoder.bind(args, model_factory=factory), llm.bind(args), args
    )
    serve.run(app, name=name, route_prefix=f"/{name}", logging_config=QUIET)


def request(i: int, words: int, model: str) -> dict:
    images = [
        {"type": "image_url", "image_url": {"url": data_url(make_image(SIDE, SIDE, seed=4 * i + k))}} for k in range(4)
    ]
    text = {"type": "text", "text": " ".join(["describe"] * words)}
    return {"model": model, "messages": [{"role": "user", "content": [text, *images]}], "max_tokens": 1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8, help="measured requests per app")
    parser.add_argument("--words", type=int, default=200)
    parser.add_argument("--image-s", type=float, default=0.0, help="slow the ViT to this many seconds an image")
    args = parser.parse_args(argv)
    checkpoint = bench_checkpoint(Path("bench_results/checkpoints"), CHECKPOINT)
    spec = ModelSpec.load(checkpoint, device="cpu")
    seconds_per_gflop = args.image_s / spec.image_cost.gflop(spec.processing.grid_thw(SIDE, SIDE))
    ttft: dict[str, list[float]] = {"on": [], "off": []}
    with ray_serve() as port:
        for name in ttft:
            deploy(name, checkpoint, name == "on", seconds_per_gflop)
            wait_healthy(f"http://127.0.0.1:{port}/{name}", 180)
        model = httpx.get(f"http://127.0.0.1:{port}/on/v1/models", timeout=30).json()["data"][0]["id"]
        for i in range(args.requests + 1):  # the first of each: a warm-up, not counted
            for name in ttft:
                start = time.monotonic()
                body = request(2 * i + (name == "off"), args.words, model)
                r = httpx.post(f"http://127.0.0.1:{port}/{name}/v1/chat/completions", json=body, timeout=300)
                assert r.status_code == 200, r.text
                if i:
                    ttft[name].append(time.monotonic() - start)
    on, off = (statistics.median(ttft[k]) for k in ("on", "off"))
    print(
        f"4 images of {SIDE}x{SIDE} (256 tokens each) after {args.words} words, one image per encoder forward, "
        f"ViT {'as is' if not args.image_s else f'{args.image_s:g} s an image'}, {args.requests} requests each"
    )
    print("| overlap | TTFT p50 s | mean s | min s | max s |\n| --- | --- | --- | --- | --- |")
    for k, xs in ttft.items():
        print(f"| {k} | {statistics.median(xs):.3f} | {statistics.mean(xs):.3f} | {min(xs):.3f} | {max(xs):.3f} |")
    print(f"overlap: TTFT p50 of 4-image requests on/off = {on / off:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
