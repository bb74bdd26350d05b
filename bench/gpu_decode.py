"""The engine on one GPU (`python -m bench.gpu_decode`, needs CUDA): a correctness check, decode speed of a
Qwen2-VL-2B-shaped random checkpoint in bfloat16 against the memory-bandwidth limit, and kernel launches per step
(`--parts`; by default decode, check, launches: the speed first, for a lease cut short).

1. "check", a tiny checkpoint: greedy tokens of our engine on cuda float32 (eager; the static decode step run eagerly;
   replayed as CUDA graphs; and each step launched before the last one's tokens reach the host, "ahead"; and that
   compiled) equal those on cpu float32 (mixed prompt lengths, so decode groups and prefill chunks both run), and
   cuda bfloat16 generates.
2. "decode", a random checkpoint of Qwen2-VL-2B's language-model shape (hidden 1536, 28 layers, 12 heads on 2 KV
   heads, FFN 8960; our 1k-token vocabulary, so no 150k-row embedding or lm_head), bfloat16 on cuda. B concurrent
   text requests (128 prompt tokens, `--output-len` tokens with ignore_eos) through the Engine, one engine per mode
   (MODES below). Decode reads every weight and the batch's KV once per step, so the limit is steps/s = HBM
   bandwidth / (weight bytes + mean KV bytes of a step); the bandwidth is measured here (a device-to-device copy,
   bytes read + written). Prints a markdown table.
3. "launches", the torch profiler over the same engines: kernel launches (cudaLaunchKernel and kin,
   cudaGraphLaunch), kernels run and their GPU time per decode step, for each mode (a run of 1 + K tokens minus a run
   of 1 token, over K).

`--device cpu --shape tiny` runs the same code on CPU (a check of the script; graphs are cuda only).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from demo.build_tiny import build_checkpoint
from llm import Engine, EngineConfig, Qwen2LM
from llm.model import pdl, triton_attention, triton_fused, triton_gemm
from schemas import GenerateRequest, SamplingParams

SHAPES = {
    "2b": dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
               vision_embed_dim=32, vision_depth=1, vision_heads=2, init_std=0.02),
    "tiny": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
                 vision_embed_dim=32, vision_depth=1, vision_heads=2, init_std=0.02),
}  # fmt: skip
# mode: (static_decode, cuda_graphs, compile_decode, async_decode, the layers' Triton kernels: "all"; "prefold" (all
# but the folds of 2026-12-05: the attention's combine, the norms, RoPE + KV write and SiLU-mul kernels of their own,
# the residual adds in them); "fused" (not triton_gemm's either); "none"; "pdl" and "pdl-wait" (all, launched as
# below)). "ahead": each decode step launched before the last one's tokens reach the host (the default on cuda),
# "graphs" without that; "prefold": ahead without the folds; "pdl": ahead with our kernels launched by programmatic
# dependent launch (llm/model/pdl.py, off by default), the GEMMs prefetching their first weight tiles before they
# wait; "pdl-wait": the same without that prefetch; "cublas": ahead with every GEMM by cuBLAS; "unfused": also
# torch's small ops where llm/model/triton_fused.py has kernels (the step before all three)
MODES = {"eager": (False, False, False, False, "all"), "static": (True, False, False, False, "all"),
         "graphs": (True, True, False, False, "all"), "ahead": (True, True, False, True, "all"),
         "prefold": (True, True, False, True, "prefold"), "cublas": (True, True, False, True, "fused"),
         "unfused": (True, True, False, True, "none"), "compiled": (True, True, True, True, "all"),
         "pdl": (True, True, False, True, "pdl"), "pdl-wait": (True, True, False, True, "pdl-wait")}  # fmt: skip
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
PROMPT = 128


def _engine(model: Qwen2LM, blocks: int, max_seqs: int, mode: str) -> Engine:
    static, graphs, compiled, ahead, _ = MODES[mode]
    _use_kernels(mode)
    config = EngineConfig(
        max_model_len=2048,
        num_blocks=blocks,
        block_size=16,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=8192,
        max_queued=4096,
        stream_interval_s=0.0,
        static_decode=static,
        cuda_graphs=graphs,
        compile_decode=compiled,
        async_decode=ahead,
    )
    return Engine(model, config, image_token_id=-1, merge_size=2, eos_token_ids=set())


def _use_kernels(mode: str) -> None:
    """The fused kernels on or off for what runs next (a graph keeps what its capture saw)."""
    kernels = MODES[mode][4]
    triton_fused.enabled, triton_gemm.enabled = kernels != "none", kernels not in ("none", "fused")
    folds = kernels in ("all", "pdl", "pdl-wait")
    triton_attention.fold_combine = triton_gemm.fuse_norm = triton_gemm.fuse_silu = triton_gemm.fuse_rope = folds
    pdl.enabled, pdl.prefetch = kernels.startswith("pdl"), kernels == "pdl"


async def _run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    async def one(i: int, ids: list[int]) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        out = []
        async for chunk in engine.generate(GenerateRequest(request_id=f"r{i}", prompt_token_ids=ids, sampling=params)):
            out += chunk.token_ids
        return out

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _prompts(g: torch.Generator, n: int, length: int = PROMPT) -> list[list[int]]:
    return [torch.randint(3, 900, (length,), generator=g).tolist() for _ in range(n)]


def check(tmp: Path, device: str, modes: tuple[str, ...] = tuple(MODES)) -> None:
    ckpt = build_checkpoint(tmp / "tiny", init_std=0.5)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 900, (n,), generator=g).tolist() for n in (5, 40, 130, 300, 17, 77)]
    runs = [(device, torch.float32, m) for m in (modes if device == "cuda" else ("static", "ahead"))]
    outs = {}
    for dev, dtype, mode in [("cpu", torch.float32, "eager"), *runs, (device, torch.bfloat16, runs[-1][2])]:
        model = Qwen2LM.from_pretrained(ckpt, device=dev, dtype=dtype)
        outs[(dev, dtype, mode)] = asyncio.run(_run(_engine(model, 256, 8, mode), prompts, 24))
    cpu = outs[("cpu", torch.float32, "eager")]
    for dev, dtype, mode in runs:
        same = outs[(dev, dtype, mode)] == cpu
        print(f"check: {dev} float32 {mode}: greedy tokens == cpu float32 eager: {same}", flush=True)
        if not same:
            raise SystemExit(f"{dev} {mode} and cpu disagree")
    bf16 = outs[(device, torch.bfloat16, runs[-1][2])]
    print(f"check: {device} bfloat16 {runs[-1][2]} generated {sum(map(len, bf16))} tokens", flush=True)


def bandwidth_gbs(device: str) -> float:
    x = torch.empty(1 << (30 if device == "cuda" else 26), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    _sync(device)
    t = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    _sync(device)
    return 2 * x.numel() * 20 / (time.perf_counter() - t) / 1e9


def _blocks(b: int, output_len: int) -> int:
    return max(b * (PROMPT + output_len) // 16 + 2 * b, 2048 // 16) + 16


def decode(model: Qwen2LM, device: str, batches: list[int], output_len: int, modes: list[str]) -> dict:
    """One engine per mode (max_num_seqs the largest batch), every batch through it; returns the engines."""
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "embed_tokens.weight")
    bw = bandwidth_gbs(device)
    kv_per_step = lambda b: b * (PROMPT + output_len / 2) * model.kv_bytes_per_token()  # noqa: E731 mean context
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(
        f"\n{name}, torch {torch.__version__}; weights read per step {weight_bytes / 1e9:.2f} GB (without the "
        f"embedding table) + the batch's KV; copy bandwidth {bw:.0f} GB/s; {PROMPT} prompt + {output_len} output "
        f"tokens per request\n\n"
        "| batch | step | output tok/s | steps/s | ms/step | bandwidth limit steps/s | share of it |\n"
        "| --- | --- | --- | --- | --- | --- | --- |",
        flush=True,
    )
    g, engines = torch.Generator().manual_seed(1), {}
    for mode in modes:
        t0 = time.perf_counter()
        engines[mode] = engine = _engine(model, _blocks(max(batches), output_len), max(batches), mode)
        print(f"({mode}: engine started in {time.perf_counter() - t0:.1f} s)", flush=True)
        asyncio.run(_run(engine, _prompts(g, 1), 8))  # warm-up
        for b in batches:
            limit = bw * 1e9 / (weight_bytes + kv_per_step(b))
            steps0 = engine.counts["steps"]
            _sync(device)
            t = time.perf_counter()
            outs = asyncio.run(_run(engine, _prompts(g, b), output_len))
            _sync(device)
            wall = time.perf_counter() - t
            steps = engine.counts["steps"] - steps0
            print(
                f"| {b} | {mode} | {sum(map(len, outs)) / wall:.0f} | {steps / wall:.1f} | {1000 * wall / steps:.2f} "
                f"| {limit:.0f} | {steps / wall / limit:.1%} |",
                flush=True,
            )
    return engines


def launches(engines: dict, device: str, b: int, k: int = 16, top: int = 10) -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    print(
        f"\nper decode step at batch {b} (torch profiler; a run of {1 + k} tokens minus one of 1, over {k}):\n\n"
        "| step | launches | kernels run | GPU busy ms | wall ms |\n| --- | --- | --- | --- | --- |",
        flush=True,
    )
    g, tops = torch.Generator().manual_seed(2), {}
    for mode, engine in engines.items():  # fresh prompts each run: no prefix-cache hits
        seen, names = [], []
        _use_kernels(mode)
        for tokens in (1, 1 + k):
            with profile(activities=activities) as prof:
                t = time.perf_counter()
                asyncio.run(_run(engine, _prompts(g, b), tokens))
                _sync(device)
                wall = time.perf_counter() - t
            events = prof.events()
            kernels = [e for e in events if e.device_type == DeviceType.CUDA]
            busy = sum(e.time_range.elapsed_us() for e in kernels) / 1000
            seen.append((sum(e.name in LAUNCHES for e in events), len(kernels), busy, 1000 * wall))
            by_name: dict[str, list[float]] = {}
            for e in kernels:
                entry = by_name.setdefault(e.name, [0, 0.0])
                entry[0], entry[1] = entry[0] + 1, entry[1] + e.time_range.elapsed_us()
            names.append(by_name)
        per = [(after - before) / k for before, after in zip(*seen, strict=True)]
        print(f"| {mode} | {per[0]:.0f} | {per[1]:.0f} | {per[2]:.2f} | {per[3]:.2f} |", flush=True)
        step = {n: [(c - names[0].get(n, [0, 0.0])[0]) / k, (us - names[0].get(n, [0, 0.0])[1]) / k]
                for n, (c, us) in names[1].items()}  # fmt: skip
        tops[mode] = sorted(step.items(), key=lambda kv: -kv[1][1])[:top]
    for mode, rows in tops.items():
        print(f"\n{mode}: the {top} kernels of most GPU time per step\n\n| kernel | per step | us per step |\n"
              "| --- | --- | --- |", flush=True)  # fmt: skip
        for name, (count, us) in rows:
            print(f"| `{name[:90]}` | {count:.1f} | {us:.0f} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_decode", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", choices=sorted(SHAPES), default="2b")
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--profile-batch", type=int, default=8)
    # the speed first, newest modes first: a lease that ends early still has what the last change is to be judged by
    p.add_argument("--parts", default="decode,check,launches")
    checked = ",".join(m for m in MODES if m != "compiled")  # compile_decode is off (and ~2 minutes to compile)
    p.add_argument("--check-modes", default=checked, help="of the check (cuda); default all but compiled")
    modes_help = "of the decode table; default ahead,pdl,pdl-wait,prefold,unfused,eager (cpu: eager,static,ahead)"
    p.add_argument("--modes", help=modes_help)
    args = p.parse_args(argv)
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("llm.engine.decode_step").setLevel(logging.INFO)  # compile and capture times
    logging.getLogger("llm.model.triton_gemm").setLevel(logging.INFO)  # which GEMMs run ours, and their times
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device (or --device cpu --shape tiny)")
        return 2
    default = "ahead,pdl,pdl-wait,prefold,unfused,eager" if args.device == "cuda" else "eager,static,ahead"
    modes = (args.modes or default).split(",")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    failed, engines = 0, {}
    with tempfile.TemporaryDirectory() as tmp:
        model = None
        for part in args.parts.split(","):
            try:  # NOTE: each part on its own: one that fails still lets the others report (one GPU lease, one run)
                t0 = time.perf_counter()
                if part == "check":
                    check(Path(tmp), args.device, tuple(args.check_modes.split(",")))
                else:
                    if model is None:
                        ckpt = build_checkpoint(Path(tmp) / args.shape, **SHAPES[args.shape])
                        model = Qwen2LM.from_pretrained(ckpt, device=args.device, dtype=dtype)
                        print(f"{args.shape} checkpoint built and loaded in {time.perf_counter() - t0:.0f} s")
                    if part == "decode":
                        batches = [int(b) for b in args.batches.split(",")]
                        engines = decode(model, args.device, batches, args.output_len, modes)
                    else:
                        launches(engines, args.device, args.profile_batch)
                print(f"[{part}: {time.perf_counter() - t0:.0f} s]", flush=True)
            except Exception:
                failed += 1
                traceback.print_exc()
                print(f"[{part}: FAILED]", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
