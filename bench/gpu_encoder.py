"""The vision encoder on one GPU (`python -m bench.gpu_encoder`): images/s and model FLOPs utilisation (MFU) of our
Qwen2-VL encoder (ViT + patch merger) at 448x448 and 1344x1344, on a random checkpoint of Qwen2-VL-2B's vision shape
(embed 1280, depth 32, 16 heads, MLP ratio 4, merged into the LM's 1536), in bfloat16.

The forward is timed on preprocessed images (the GPU's part; preprocessing runs on the replica's CPU and is in
`make bench-encoder`). FLOPs per image are the ones the autoscaler counts (encoders/cost.py: linear layers and the
attention pairs of every layer); MFU is FLOPs / time against the card's dense bf16 peak and against an 8192^3 bf16
matmul measured here. `--device cpu --shape tiny` runs the same code on a tiny shape (a check of the script).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu_decode import _sync
from bench.workload import parse_sizes
from demo.build_tiny import build_checkpoint
from demo.inputs import make_image

SHAPES = {
    "2b": dict(vision_embed_dim=1280, vision_depth=32, vision_heads=16, vision_mlp_ratio=4, hidden_size=1536),
    "tiny": dict(vision_embed_dim=64, vision_depth=2, vision_heads=2, vision_mlp_ratio=4, hidden_size=64),
}
# Dense bf16 tensor-core peak of the card (no sparsity), from NVIDIA's datasheets (SXM parts).
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of fn() over reps runs after two warm-ups."""
    fn(), fn()
    times = []
    for _ in range(reps):
        _sync(device.type)
        t = time.perf_counter()
        fn()
        _sync(device.type)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def matmul_tflops(device: torch.device, dtype: torch.dtype) -> float:
    n = 8192 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timed(lambda: a @ b, device, 10) / 1e12


def run(tmp: Path, args: argparse.Namespace) -> list[str]:
    from transformers import AutoConfig

    from encoders.qwen2_vl import Qwen2VLVisionEncoder, qwen2_vl_cost

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sizes = parse_sizes(args.sizes)
    t0 = time.perf_counter()
    ckpt = build_checkpoint(
        tmp / "vit", num_layers=1, max_pixels=max(w * h for w, h in sizes), init_std=0.02, **SHAPES[args.shape]
    )
    encoder = Qwen2VLVisionEncoder(ckpt, device=args.device, dtype=dtype)
    cost = qwen2_vl_cost(AutoConfig.from_pretrained(ckpt))
    params = sum(p.numel() for p in encoder.vit.parameters())
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    measured = matmul_tflops(device, dtype)
    lines = [
        f"{name}, torch {torch.__version__}, {args.dtype}; ViT {params / 1e6:.0f}M parameters "
        f"(checkpoint built in {time.perf_counter() - t0:.0f} s); an 8192^3 matmul here: {measured:.0f} TFLOP/s; "
        f"datasheet peak: {peak or 'unknown'} TFLOP/s",
        "",
        "| size | patches | batch | forward ms | images/s | GFLOP/image | TFLOP/s | MFU (datasheet) | MFU (matmul) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w, h in sizes:
        for batch in [int(b) for b in args.batches.split(",")]:
            pre = [encoder.preprocess(make_image(w, h, seed=i)) for i in range(batch)]
            seconds = timed(lambda: encoder.forward(pre), device, args.reps)  # noqa: B023
            gflop = sum(cost.gflop(tuple(g)) for _, g in pre) / batch
            tflops = batch * gflop / seconds / 1e3
            mfu = f"{tflops / peak:.1%}" if peak else "-"
            lines.append(
                f"| {w}x{h} | {pre[0][0].shape[0]} | {batch} | {1000 * seconds:.1f} | {batch / seconds:.1f} | "
                f"{gflop:.0f} | {tflops:.0f} | {mfu} | {tflops / measured:.1%} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_encoder", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--shape", choices=sorted(SHAPES), default="2b")
    p.add_argument("--sizes", default="448x448,1344x1344")
    p.add_argument("--batches", default="1,8", help="images per forward")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device (or --device cpu --shape tiny)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        print("\n".join(run(Path(tmp), args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
