"""The engine on one GPU (`python -m bench.gpu_decode`, needs CUDA): a correctness check, then decode speed of a
Qwen2-VL-2B-shaped random checkpoint in bfloat16 against the memory-bandwidth limit.

1. Tiny checkpoint: greedy tokens of our engine on cuda float32, eager and with CUDA graphs (the static decode
   step), equal those on cpu float32 (mixed prompt lengths, so decode groups and prefill chunks both run), and cuda
   bfloat16 generates.
2. A random checkpoint of Qwen2-VL-2B's language-model shape (hidden 1536, 28 layers, 12 heads on 2 KV heads,
   FFN 8960; our 1k-token vocabulary, so no 150k-row embedding or lm_head), bfloat16 on cuda. B concurrent
   text requests (128 prompt tokens, `--output-len` tokens with ignore_eos) through the Engine, with CUDA graphs
   off (eager, the step as before) and on. Decode reads every weight and the batch's KV once per step, so the limit
   is steps/s = HBM bandwidth / (weight bytes + mean KV bytes of a step); the bandwidth is measured here (a
   device-to-device copy, bytes read + written). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

from demo.build_tiny import build_checkpoint
from llm import Engine, EngineConfig, Qwen2LM
from schemas import GenerateRequest, SamplingParams

SHAPE_2B = dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
                vision_embed_dim=32, vision_depth=1, vision_heads=2, init_std=0.02)  # fmt: skip


def _engine(model: Qwen2LM, blocks: int, max_seqs: int, graphs: bool = False) -> Engine:
    config = EngineConfig(
        max_model_len=2048,
        num_blocks=blocks,
        block_size=16,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=8192,
        max_queued=4096,
        stream_interval_s=0.0,
        cuda_graphs=graphs,
    )
    return Engine(model, config, image_token_id=-1, merge_size=2, eos_token_ids=set())


async def _run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    async def one(i: int, ids: list[int]) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        out = []
        async for chunk in engine.generate(GenerateRequest(f"r{i}", ids, [], [], params)):
            out += chunk.token_ids
        return out

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def check(tmp: Path) -> None:
    ckpt = build_checkpoint(tmp / "tiny", init_std=0.5)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 900, (n,), generator=g).tolist() for n in (5, 40, 130, 300, 17, 77)]
    outs = {}
    for device, dtype, graphs in (
        ("cpu", torch.float32, False),
        ("cuda", torch.float32, False),
        ("cuda", torch.float32, True),
        ("cuda", torch.bfloat16, True),
    ):
        model = Qwen2LM.from_pretrained(ckpt, device=device, dtype=dtype)
        outs[(device, dtype, graphs)] = asyncio.run(_run(_engine(model, 256, 8, graphs), prompts, 24))
    cpu = outs[("cpu", torch.float32, False)]
    same = cpu == outs[("cuda", torch.float32, False)] == outs[("cuda", torch.float32, True)]
    print(
        f"check: cuda float32 greedy tokens (eager, and CUDA graphs) == cpu float32: {same}; cuda bfloat16 with "
        f"graphs generated {sum(map(len, outs[('cuda', torch.bfloat16, True)]))} tokens"
    )
    if not same:
        raise SystemExit("cuda and cpu disagree")


def bandwidth_gbs() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 20 / (time.perf_counter() - t) / 1e9


def decode(tmp: Path, batches: list[int], output_len: int) -> None:
    ckpt = build_checkpoint(tmp / "2b", **SHAPE_2B)
    model = Qwen2LM.from_pretrained(ckpt, device="cuda", dtype=torch.bfloat16)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "embed_tokens.weight")
    bw = bandwidth_gbs()
    kv_per_step = lambda b: b * (128 + output_len / 2) * model.kv_bytes_per_token()  # noqa: E731 mean context
    print(
        f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; weights read per step "
        f"{weight_bytes / 1e9:.2f} GB (bf16, without the embedding table) + the batch's KV; copy bandwidth "
        f"{bw:.0f} GB/s\n"
    )
    print(
        "| batch | CUDA graphs | output tok/s | steps/s | ms/step | bandwidth limit steps/s | share of it |\n"
        "| --- | --- | --- | --- | --- | --- | --- |"
    )
    g = torch.Generator().manual_seed(1)
    for b, graphs in ((b, graphs) for b in batches for graphs in (False, True)):
        limit = bw * 1e9 / (weight_bytes + kv_per_step(b))
        engine = _engine(
            model, blocks=max(b * (128 + output_len) // 16 + 2 * b, 2048 // 16) + 16, max_seqs=b, graphs=graphs
        )
        prompts = [torch.randint(3, 900, (128,), generator=g).tolist() for _ in range(b)]
        asyncio.run(_run(engine, prompts[:1], 8))  # warm-up
        steps0 = engine.counts["steps"]
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = asyncio.run(_run(engine, prompts, output_len))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        steps = engine.counts["steps"] - steps0
        print(
            f"| {b} | {'on' if graphs else 'off'} | {sum(map(len, outs)) / wall:.0f} | {steps / wall:.0f} | "
            f"{1000 * wall / steps:.1f} | {limit:.0f} | {steps / wall / limit:.1%} |"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_decode", description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--output-len", type=int, default=256)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        check(Path(tmp))
        decode(Path(tmp), [int(b) for b in args.batches.split(",")], args.output_len)
    return 0


if __name__ == "__main__":
    sys.exit(main())
