"""`python -m bench.encoder` (`make bench-encoder`): the encoder tier alone, no server.

1. images/s of `Qwen2VLVisionEncoder` (the replicas' loading code) per image size and packed batch size, the ViT
   forward alone and with our preprocessing before it;
2. our preprocessing against transformers' `Qwen2VLImageProcessorPil` on the same images;
3. the time an embedding takes from an encoder-like actor's return to an LLM-like actor holding it, by size;
4. base64 decoding of image data URLs, stdlib against pybase64.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import statistics
import time
from pathlib import Path

import torch

from bench import report
from bench.encoder_transfer import base64_decode, elapsed_ms, transfer
from bench.server import bench_checkpoint
from bench.workload import parse_sizes
from demo.build_tiny import build_checkpoint
from demo.inputs import make_image

# NOTE: Qwen2-VL-2B-Instruct's preprocessor_config.json allows up to 12845056 pixels; the bench checkpoint's
# own 224*224 would shrink every size below to the same grid.
QWEN2_VL_MAX_PIXELS = 12845056
QWEN2_VL_2B_HIDDEN = 1536  # the language model's width, so the width of every image embedding row
DEMO_HIDDEN = inspect.signature(build_checkpoint).parameters["hidden_size"].default  # demo/qwen2-vl-tiny's


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.encoder", description=__doc__.splitlines()[0])
    p.add_argument(
        "--checkpoint",
        default=None,
        help="a Qwen2-VL checkpoint directory (default: the bench's random one, built if missing)",
    )
    p.add_argument("--max-pixels", type=int, default=QWEN2_VL_MAX_PIXELS, help="preprocessing's pixel cap")
    p.add_argument("--sizes", default="224x224,448x448,896x672", help="WxH, encoder throughput")
    p.add_argument("--batches", default="1,4,16", help="images per packed ViT forward")
    p.add_argument(
        "--prep-sizes",
        default="224x224,448x448,896x672,640x480,1280x720,1920x1080",
        help="WxH, preprocessing against transformers",
    )
    p.add_argument("--tokens", default="64,256,1024,4096", help="embedding rows, Ray transfer")
    p.add_argument("--base64-sizes", default="100000,1000000,8000000", help="decoded bytes, base64")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (the median is reported)")
    p.add_argument(
        "--skip", default="", help="comma-separated sections to leave out: encoder,preprocess,transfer,base64"
    )
    p.add_argument("--out-dir", default="bench_results", help="the JSON (and the bench checkpoint) go here")
    args = p.parse_args(argv)
    if args.repeats < 3:
        p.error("--repeats must be at least 3: the machine is shared, one run says little")
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    return args


def _ints(spec: str) -> list[int]:
    return [int(x) for x in spec.split(",") if x.strip()]


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.0f}"
    return "-" if value is None else str(value)


def table(title: str, rows: list[dict]) -> str:
    """A markdown table (pasted as is into BENCHMARKS.md)."""
    head = list(rows[0])
    lines = [f"\n{title}\n", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(_fmt(row[k]) for k in head) + " |" for row in rows]
    return "\n".join(lines)


def encoder_throughput(ckpt: Path, args: argparse.Namespace) -> tuple[dict, list[dict]]:
    from encoders.qwen2_vl import Qwen2VLVisionEncoder

    encoder = Qwen2VLVisionEncoder(ckpt)
    encoder.processing = dataclasses.replace(encoder.processing, max_pixels=args.max_pixels)
    vit = encoder.vit.config
    shape = {
        "vision": f"embed {vit.embed_dim} x depth {vit.depth}, {vit.num_heads} heads, mlp_ratio {vit.mlp_ratio}",
        "llm_hidden": encoder.hidden_size,
        "vision_params": sum(p.numel() for p in encoder.vit.parameters()),
        "torch_threads": torch.get_num_threads(),
    }
    cases = []
    for w, h in parse_sizes(args.sizes):
        for batch in _ints(args.batches):
            images = [make_image(w, h, seed=i) for i in range(batch)]
            cases.append((f"{w}x{h}", images, [encoder.preprocess(im) for im in images]))
            encoder.forward(cases[-1][2])  # warm-up: first-call allocations and lazy inits, per shape
    # NOTE: round-robin over the cases, so a burst of other load on the shared machine hits them all alike.
    pre_ms, fwd_ms = [[] for _ in cases], [[] for _ in cases]
    for _ in range(args.repeats):
        for i, (_, images, pre) in enumerate(cases):
            pre_ms[i].append(elapsed_ms(lambda: [encoder.preprocess(im) for im in images]))
            fwd_ms[i].append(elapsed_ms(lambda: encoder.forward(pre)))
    rows = []
    for (size, images, pre), pre_i, fwd_i in zip(cases, pre_ms, fwd_ms, strict=True):
        batch, pre_t, fwd_t = len(images), statistics.median(pre_i), statistics.median(fwd_i)
        rows.append(
            {
                "size": size,
                "patches": pre[0][0].shape[0],
                "batch": batch,
                "forward ms": fwd_t,
                "img/s forward": batch / fwd_t * 1000,
                "preprocess ms/img": pre_t / batch,
                "img/s with preprocess": batch / (pre_t + fwd_t) * 1000,
            }
        )
    return shape, rows


def preprocessing_vs_transformers(args: argparse.Namespace) -> list[dict]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from encoders.qwen2_vl import Qwen2VLImageProcessing

    ours = Qwen2VLImageProcessing(max_pixels=args.max_pixels)
    ref = Qwen2VLImageProcessorPil(min_pixels=ours.min_pixels, max_pixels=args.max_pixels)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like for like: the PIL/numpy reference runs on one thread
    try:
        rows = []
        for w, h in parse_sizes(args.prep_sizes):
            image = make_image(w, h, seed=w * 7 + h)
            pixel_values, grid = ours.preprocess(image)
            expected = ref(images=[image], return_tensors="pt")
            assert grid == tuple(expected["image_grid_thw"][0].tolist())
            ours_fn, ref_fn = lambda: ours.preprocess(image), lambda: ref(images=[image], return_tensors="pt")
            ours_fn(), ref_fn()  # warm-up
            # NOTE: alternated, so a burst of other load on the shared machine hits both alike.
            times = [(elapsed_ms(ours_fn), elapsed_ms(ref_fn)) for _ in range(max(args.repeats, 15))]
            ours_ms, ref_ms = (statistics.median(t) for t in zip(*times))
            rw, rh = ours.resized_size(w, h)
            rows.append(
                {
                    "size": f"{w}x{h}",
                    "resized to": f"{rw}x{rh}",
                    "ours ms": ours_ms,
                    "transformers ms": ref_ms,
                    "speedup": ref_ms / ours_ms,
                    "max abs diff": float((pixel_values - expected["pixel_values"]).abs().max()),
                }
            )
        return rows
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    machine = report.machine_info()
    print(
        f"{machine['date']}  {machine['cpu']} ({machine['cores']} cores), torch {machine['torch']}, "
        f"transformers {machine['transformers']}, ray {machine['ray']}; load average {machine['loadavg_at_start']}; "
        f"each figure is the median of {args.repeats}+ timed runs"
    )
    results: dict = {
        "machine": machine,
        "args": {k: v if not isinstance(v, set) else sorted(v) for k, v in vars(args).items()},
    }
    llm_hidden = QWEN2_VL_2B_HIDDEN
    if "encoder" not in args.skip:
        ckpt = Path(args.checkpoint) if args.checkpoint else bench_checkpoint(out_dir)
        shape, rows = encoder_throughput(ckpt, args)
        llm_hidden = shape["llm_hidden"]
        note = (
            "the bench's random checkpoint (bench/server.py, far smaller than Qwen2-VL-2B's ViT of "
            "embed 1280 x depth 32, mlp_ratio 4: read the scaling, not the absolute figures)"
            if args.checkpoint is None
            else str(ckpt)
        )
        results["encoder"] = {"checkpoint": str(ckpt), "shape": shape, "rows": rows}
        print(
            table(
                f"1. Qwen2VLVisionEncoder on cpu, float32, {shape['torch_threads']} torch threads; "
                f"{shape['vision']} ({shape['vision_params']:,} parameters), llm_hidden {shape['llm_hidden']}: "
                f"{note}. 'patches' per image (4 patches = 1 embedding row); max_pixels {args.max_pixels}. "
                "'img/s with preprocess' = images / (their preprocessing, one after another, + the forward).",
                rows,
            )
        )
    if "preprocess" not in args.skip:
        rows = preprocessing_vs_transformers(args)
        results["preprocess"] = rows
        print(
            table(
                "2. Preprocessing one image (resize, rescale, normalize, patchify; already-decoded RGB), ms, "
                "one thread each: ours (encoders/qwen2_vl.py) against transformers' Qwen2VLImageProcessorPil "
                "(the fast one needs torchvision, absent here). 'max abs diff' of pixel_values.",
                rows,
            )
        )
    if "transfer" not in args.skip:
        hiddens = sorted({QWEN2_VL_2B_HIDDEN, llm_hidden, DEMO_HIDDEN}, reverse=True)
        rows = transfer(_ints(args.tokens), hiddens, ["float32", "bfloat16"], args.repeats, zero_copy=False)
        fast = transfer(_ints(args.tokens), hiddens, ["float32", "bfloat16"], args.repeats, zero_copy=True)
        ours = transfer(_ints(args.tokens), hiddens, ["float32", "bfloat16"], args.repeats, zero_copy=False, ours=True)
        for row, z, o in zip(rows, fast, ours, strict=True):
            row |= {"zero-copy ms": z["ms"], "zero-copy MB/s": z["MB/s"], "ours ms": o["ms"], "ours MB/s": o["MB/s"]}
        results["transfer"] = rows
        print(
            table(
                "3. Embedding (tokens, hidden) from an actor's return to another actor holding it (the "
                "ObjectRef passed in a list and awaited), one node: consumer's time.time() after the await minus "
                "the producer's just before its return, median; 'ms over floor' subtracts the empty tensor's "
                "time; MB/s = MB / ms (whole trip). 'zero-copy': the same with "
                "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1 in the workers; 'ours': the producer registers "
                "deployments/transfer.py's serializer, as Encoder replicas do.",
                rows,
            )
        )
    if "base64" not in args.skip:
        rows = base64_decode(_ints(args.base64_sizes), max(args.repeats, 15))
        results["base64"] = rows
        print(table("4. base64 decode of a str payload with validate=True, ms (median); 'bytes' decoded.", rows))
    out = out_dir / f"encoder-{time.strftime('%Y%m%d-%H%M%S')}.json"
    report.write_json(out, results)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
