"""`make bench-tier`: the encoder tier against encoders colocated in the LLM replica, where the tier should win.

Two Ray nodes on this machine, each pinned to a core of its own (`taskset -c N ray start`, bench/two_nodes.py), as
two machines would be, and one checkpoint whose ViT weighs against its LM what Qwen2-VL-2B's does (TIER_CHECKPOINT:
the ViT's compute per image token over the LM's). Three layouts, one after the other on the same nodes:
- **tier**: the LLM replica and the ingress on node 0, an Encoder replica on node 1 (the README's cluster recipe);
  **tier1**: the same with the ingress beside the Encoder, off the LLM's core;
- **colocated**: the LLM replica encodes its images itself, on node 0; node 1 idle (what adding encoder hardware
  buys, when it is not used);
- **dp2**: a colocated LLM replica on each node (the same hardware as the tier: the baseline of vLLM's and SGLang's
  encoder-disaggregation figures).

Each layout, in order:
1. **CPU per image**: requests of three fresh images (224x224, 160x112, 96x96; the issue's mix), `max_tokens` 1,
   16 in flight: CPU time of every process of the cluster from /proc (bench/proc_cpu.py), per image, by process;
   then the same images again after another leading text (embedding-cache hits, no prefix-cache reuse).
2. **Unloaded**: `--text-streams` text-only streams in a closed loop (long outputs) for `--unloaded-s`.
3. **Loaded**: the same streams, and image requests arriving as a Poisson stream (`--rate`) for `--loaded-s`: 1 to 4
   images each, half small (224x224) half large (448x448), vLLM's random-mm mix scaled down.
Measured: image TTFT p50/p99, the text streams' TPOT p50/p99 unloaded and loaded, output tok/s, images/s, the share
of requests (text and image) that meet both the TTFT bound and the TPOT bound (both printed; the same for every
layout), and goodput as DistServe and vLLM's encoder-disaggregation post define it: the highest image request rate
at which `--attainment` (90%) of the requests meet both (interpolated between the rates of the sweep).

Then **scale-out**: a cluster on both cores, the tests' tiny checkpoint, and a ViT that only sleeps for each batch's
cost (bench/slow_vit.py's SleepViT: a GPU's forward takes no CPU of the host), one-image requests at
`--scale-concurrency`: the tier's images/s with 1, 2 and 4 Encoder replicas, and the CPU per image that is the tier's
own (every process, less the engine's steps).

The last line: `tier: cpu/image tier/colocated Ax; images/s 4 replicas/1 Bx; TPOT p99 loaded/unloaded Cx; goodput
tier/DP2 Dx`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np

from bench import proc_cpu
from bench.client import _one
from bench.metrics import RequestResult, aggregate
from bench.server import CHECKPOINT_PARAMS, bench_checkpoint
from bench.two_nodes import PinnedNodes
from bench.workload import data_url, noise_png, stream_body
from demo.local import serve_env

# The bench LM (hidden 512, 8 layers: 23.6M parameters a token) and a ViT of 6 blocks of 384 with Qwen's MLP ratio
# (10.6M parameters a patch, 4 patches a token, and the merger): 1.9x the LM's compute per image token, as
# Qwen2-VL-2B's 675M-parameter ViT against its 1.3B-parameter LM (2.1x).
TIER_CHECKPOINT = {
    **CHECKPOINT_PARAMS,
    "vision_embed_dim": 384,
    "vision_depth": 6,
    "vision_heads": 6,
    "vision_mlp_ratio": 4,
    "max_pixels": 448 * 448,
}
# Issue 54's comparison: a Qwen3-VL of TIER_CHECKPOINT's shapes (LM 512 x 8, ViT 384 x 6, MLP 4x) with the released
# models' three DeepStack levels, beside that Qwen2-VL: its embeddings are (1 + 3) times as wide.
QWEN3_TIER_CHECKPOINT = {
    "seed": 0, "hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1408,
    "vision_hidden_size": 384, "vision_depth": 6, "vision_heads": 6, "vision_mlp_ratio": 4,
    "deepstack_indexes": [1, 3, 5], "num_position_embeddings": 1024, "mrope_section": [12, 10, 10],
    "init_std": 0.02, "vision_std": 0.02, "deepstack_gain": 1.0, "max_pixels": 448 * 448,
}  # fmt: skip
FAMILY_CHECKPOINTS = {"qwen2_vl": TIER_CHECKPOINT, "qwen3_vl": QWEN3_TIER_CHECKPOINT}
# The scale-out's: the tests' tiny model (its LM's forward is a few hundred microseconds), images up to 224x224.
TINY_CHECKPOINT = {"seed": 0, "max_pixels": 224 * 224}
CPU_SIZES = [(224, 224), (160, 112), (96, 96)]
SMALL, LARGE = (224, 224), (448, 448)


@dataclass
class Layout:
    name: str
    colocated: bool
    llm_nodes: list[int]  # one LLM replica on each
    encoder_node: int | None = None
    ingress_node: int = 0


# The ingress with the LLM, as the README's cluster recipe has it on the head node ("tier"), or beside the encoders
# ("tier1"): its CPU work (HTTP, base64, hashing, tokenizing, SSE) then leaves the LLM's core to decode.
LAYOUTS = {
    "tier": Layout("tier", False, [0], encoder_node=1, ingress_node=0),
    "tier1": Layout("tier1", False, [0], encoder_node=1, ingress_node=1),
    "colocated": Layout("colocated", True, [0]),
    "dp2": Layout("dp2", True, [0, 1]),
}


def build(layout: Layout, args: dict, encoder_factory=None, encoder_replicas: int = 1):
    """deployments/app.py's graph, each deployment placed on its node (`node<i>` resources)."""
    from deployments.encoder.autoscaling import AUTOSCALING
    from deployments.encoder.server import Encoder
    from deployments.ingress import Ingress
    from deployments.llm.server import LLM
    from schemas import AppArgs

    plain = AppArgs.model_validate({**args, "encoder": {**args.get("encoder", {}), "colocated": layout.colocated}})
    plain = plain.model_dump()

    def on(node: int, cpus: float) -> dict:
        return {"num_cpus": cpus, "resources": {f"node{node}": 0.01}}

    ingress = Ingress.options(ray_actor_options=on(layout.ingress_node, 0.1))
    if len(layout.llm_nodes) == 1:
        llm = LLM.options(ray_actor_options=on(layout.llm_nodes[0], 1))
    else:  # one a node: each node has one `lm`
        llm = LLM.options(ray_actor_options={"num_cpus": 1, "resources": {"lm": 1}}, num_replicas=len(layout.llm_nodes))
    encoder = None
    if layout.encoder_node is not None:
        fixed = {**AUTOSCALING, "min_replicas": encoder_replicas, "max_replicas": encoder_replicas}
        options = {"ray_actor_options": on(layout.encoder_node, 1), "autoscaling_config": fixed}
        if encoder_factory is None:
            encoder = Encoder.options(**options).bind(plain)
        else:
            encoder = Encoder.options(**options).bind(plain, model_factory=encoder_factory)
    return ingress.bind(encoder, llm.bind(plain), plain)


# ---- Requests ------------------------------------------------------------------------------------------------------


def _image(png: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(png)}}


def cpu_bodies(n: int, seed: int, lead: str) -> list[dict]:
    """n requests of three fresh images each (the same for the same seed), after a leading text `lead`."""
    out = []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        images = [_image(noise_png(w, h, rng)) for w, h in CPU_SIZES]
        out.append(
            stream_body([{"type": "text", "text": f"{lead} {i}."}, *images, {"type": "text", "text": "Which?"}], 1)
        )
    return out


def image_bodies(n: int, seed: int, max_tokens: int) -> tuple[list[dict], list[int]]:
    """n requests of 1 to 4 images, each small or large at even odds (fresh pixels: no cache hits), and the number
    of images of each."""
    bodies, counts = [], []
    for i in range(n):
        rng = np.random.default_rng([seed, 7, i])
        k = int(rng.integers(1, 5))
        sizes = [SMALL if rng.random() < 0.5 else LARGE for _ in range(k)]
        images = [_image(noise_png(w, h, rng)) for w, h in sizes]
        bodies.append(
            stream_body([*images, {"type": "text", "text": f"Describe picture set {i} in words."}], max_tokens)
        )
        counts.append(k)
    return bodies, counts


def text_body(stream: int, k: int, max_tokens: int) -> dict:
    return stream_body(f"Stream {stream}, request {k}: count slowly from one upwards, in words.", max_tokens)


# ---- Phases --------------------------------------------------------------------------------------------------------


async def closed_loop(url: str, bodies: list[dict], concurrency: int, timeout: float) -> list[RequestResult]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        t0 = time.perf_counter()

        async def one(i: int, body: dict) -> RequestResult:
            async with gate:
                return await _one(client, i, body, t0, timeout)

        return list(await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies))))


def cpu_phase(url: str, roots: list[int], n: int, seed: int, timeout: float) -> dict:
    """CPU seconds by process: first `n` requests of fresh images (misses), then the same images again after another
    leading text (embedding-cache hits; no prefix-cache reuse, which would skip the images' prefill)."""
    out = {}
    for name, lead in (("miss", "First look"), ("hit", "Second look")):
        before = proc_cpu.snapshot(roots)
        started = time.perf_counter()
        results = asyncio.run(closed_loop(url, cpu_bodies(n, seed, lead), 16, timeout))
        wall = time.perf_counter() - started
        cpu = proc_cpu.cpu_by_role(before, proc_cpu.snapshot(roots))
        out[name] = {"cpu": cpu, "images": n * len(CPU_SIZES), "wall": wall, "failed": sum(not r.ok for r in results)}
    return out


async def _mixed(url: str, opts, windows: list[tuple[float, list[dict], list[float]]], roots: list[int], llm) -> dict:
    """Text streams throughout; alone for `opts.unloaded_s`, then one window per image rate: its requests sent
    `gaps` apart (a window lasts until its last request is answered). CPU snapshots at every window's edges."""
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=opts.timeout, limits=limits) as client:
        t0 = time.perf_counter()
        stop = asyncio.Event()

        async def stream(k: int) -> list[RequestResult]:
            results = []
            while not stop.is_set():
                results.append(await _one(client, k, text_body(k, len(results), opts.text_tokens), t0, opts.timeout))
            return results

        async def edge() -> tuple[float, dict, list[float]]:
            """Now: its time, the processes' CPU, each LLM replica's seconds in steps that carried a prefill."""
            stats = await asyncio.to_thread(lambda: llm.broadcast("stats").results(timeout_s=60))
            return time.perf_counter() - t0, proc_cpu.snapshot(roots), [s["prefill_step_s"] for s in stats]

        async def images() -> list[dict]:
            await asyncio.sleep(opts.unloaded_s)
            edges = [await edge()]
            out = []
            for rate, bodies, gaps in windows:
                tasks = []
                for i, (body, gap) in enumerate(zip(bodies, gaps, strict=True)):
                    await asyncio.sleep(gap)
                    tasks.append(asyncio.create_task(_one(client, i, body, t0, opts.timeout)))
                results = list(await asyncio.gather(*tasks))
                edges.append(await edge())
                out.append({"rate": rate, "results": results, "edges": edges[-2:]})
            stop.set()
            return out

        streams = [asyncio.create_task(stream(k)) for k in range(opts.text_streams)]
        by_window = await images()
        return {"windows": by_window, "text": [r for t in streams for r in await t]}


def traffic_phase(url: str, opts, roots: list[int], seed: int) -> dict:
    """Unloaded text streams, then the same with the image stream at each rate of `opts.rates`; each text request
    is counted in the window it started in. The raw results (`merge` aggregates the passes of a layout)."""
    windows = []
    for k, rate in enumerate(opts.rates):
        n = max(1, round(rate * opts.window_s))
        bodies, counts = image_bodies(n, seed * 100 + k, opts.image_tokens)
        gaps = np.random.default_rng([seed, 99, k]).exponential(1.0 / rate, n).tolist()
        windows.append((rate, bodies, gaps, counts))
    from ray import serve

    llm = serve.get_deployment_handle("LLM", "tier")
    run = asyncio.run(_mixed(url, opts, [w[:3] for w in windows], roots, llm))
    first = run["windows"][0]["edges"][0][0]
    out = {
        "unloaded": [r for r in run["text"] if r.sent + r.e2e <= first and r.sent >= 2.0],  # 2 s: warm-up
        "unloaded_s": first - 2.0,
        "rates": [],
    }
    for window, (_, _, _, counts) in zip(run["windows"], windows, strict=True):
        (lo, cpu0, prefill0), (hi, cpu1, prefill1) = window["edges"]
        out["rates"].append(
            {
                "rate": window["rate"],
                "span": hi - lo,
                "images": window["results"],
                "counts": counts,
                "text": [r for r in run["text"] if lo <= r.sent < hi],
                "cpu": proc_cpu.cpu_by_role(cpu0, cpu1, by_cpus=True),
                # each LLM replica's seconds in steps that carried a prefill (the decodes beside them waited)
                "prefill": [b - a for a, b in zip(prefill0, prefill1, strict=True)],
            }
        )
    return out


def _add(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in a.keys() | b.keys()}


def pool_cpu(phases: list[dict]) -> dict:
    """CPU phases (cpu_phase's, one a pass) pooled: images a second, CPU ms per image (total and by process)."""
    cpu, images = functools.reduce(_add, (p["cpu"] for p in phases), {}), sum(p["images"] for p in phases)
    return {
        "images_per_s": images / sum(p["wall"] for p in phases),
        "cpu_ms_per_image": _per(cpu, images),
        "total_ms_per_image": sum(cpu.values()) * 1000 / images,
        "failed": sum(p["failed"] for p in phases),
    }


def merge(passes: list[dict], opts) -> dict:
    """A layout's passes pooled: their requests together for the percentiles, their CPU seconds and windows summed."""
    out: dict = {"passes": len(passes), "cpu": {w: pool_cpu([p["cpu"][w] for p in passes]) for w in ("miss", "hit")}}
    unloaded = [r for p in passes for r in p["traffic"]["unloaded"]]
    span = sum(p["traffic"]["unloaded_s"] for p in passes)
    out["text_unloaded"] = aggregate(unloaded, span, opts.ttft_bound, opts.tpot_bound)
    out["rates"] = []
    for k, rate in enumerate(opts.rates):
        ws = [p["traffic"]["rates"][k] for p in passes]
        images = [r for w in ws for r in w["images"]]
        counts = [c for w in ws for c in w["counts"]]
        text = [r for w in ws for r in w["text"]]
        span = sum(w["span"] for w in ws)
        cpu: dict[str, float] = {}
        for w in ws:
            cpu = _add(cpu, w["cpu"])
        both = aggregate(text + images, span, opts.ttft_bound, opts.tpot_bound)
        out["rates"].append(
            {
                "rate": rate,
                "window_s": span,
                "image": aggregate(images, span, opts.ttft_bound, opts.tpot_bound),
                "text": aggregate(text, span, opts.ttft_bound, opts.tpot_bound),
                "goodput_req_per_s": both["goodput_req_per_s"],
                "good_share": both["goodput_req_per_s"] * span / max(1, both["requests"]),
                "out_tok_per_s": both["out_tok_per_s"],
                "images_per_s": sum(n for r, n in zip(images, counts, strict=True) if r.ok) / span,
                "cores_by_process": {k: v / span for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])},
                "prefill_share": [sum(x) / span for x in zip(*(w["prefill"] for w in ws), strict=True)],
            }
        )
    out["goodput_rate"] = goodput_rate(out["rates"], opts.attainment)
    return out


def goodput_rate(windows: list[dict], attainment: float) -> float:
    """The highest image rate at which `attainment` of the requests met both bounds: the sweep's rates, and between
    two of them where the share crosses it, linearly (0 if the lowest misses it; the highest if none does)."""
    best = 0.0
    for lo, hi in zip([None, *windows], windows, strict=False):
        if hi["good_share"] >= attainment:
            best = hi["rate"]
        elif lo is not None and lo["good_share"] >= attainment:  # crossed between lo and hi
            return lo["rate"] + (hi["rate"] - lo["rate"]) * (lo["good_share"] - attainment) / (
                lo["good_share"] - hi["good_share"]
            )
        else:
            return best
    return best


def run_layout(
    cluster: PinnedNodes, layout: Layout, checkpoint: Path, opts, ports: list[int], seed: int, traffic: bool = True
) -> dict:
    """One pass of a layout: deployed, warmed up, its CPU per image, its traffic (raw; not without `traffic`),
    deleted."""
    from ray import serve

    args = {
        "model": str(checkpoint),
        "llm": {"max_model_len": 4096, **opts.llm_args},
        "limits": {"max_images_per_request": 8},
        "encoder": {"cache_gib": opts.cache_gib},
    }
    started = time.monotonic()
    serve.run(build(layout, args), name="tier", route_prefix="/", logging_config=QUIET)
    url = ingress_url(ports)
    deploy_s = time.monotonic() - started
    asyncio.run(closed_loop(url, cpu_bodies(2, 999, "Warm up"), 2, opts.timeout))
    asyncio.run(closed_loop(url, [text_body(0, 0, 8)], 1, opts.timeout))
    roots = cluster.processes()
    out = {"deploy_s": deploy_s, "cpu": cpu_phase(url, roots, opts.cpu_requests, seed, opts.timeout)}
    if traffic:
        out["traffic"] = traffic_phase(url, opts, roots, seed)
    serve.delete("tier")
    return out


def scale_out(opts, out_dir: Path) -> dict:
    """The tier's images/s with 1, 2, 4 Encoder replicas whose ViT only sleeps; the rest of the app as shipped."""
    from ray import serve

    from bench.slow_vit import SleepViT
    from encoders import ModelSpec

    checkpoint = bench_checkpoint(out_dir, TINY_CHECKPOINT)
    spec = ModelSpec.load(checkpoint, device="cpu")
    seconds_per_gflop = opts.scale_image_s / spec.image_cost.gflop(spec.processing.grid_thw(*SMALL))
    env, ports = _cluster_env()
    out = {}
    with PinnedNodes(["0-1"], env, logical_cpus=16) as cluster:
        cluster.connect()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": _free()})
        args = {"model": str(checkpoint), "llm": {"max_model_len": 1024}, "encoder": {"cache_gib": 0}}
        factory = functools.partial(SleepViT, seconds_per_gflop=seconds_per_gflop)
        raw: dict[int, dict] = {}
        order = [k for r in range(opts.rounds) for k in (opts.scale_replicas[:: 1 if r % 2 == 0 else -1])]
        for i, replicas in enumerate(order):  # as the layouts: 1 2 4, 4 2 1, ... pooled
            layout = Layout("tier", False, [0], encoder_node=0)
            app = build(layout, args, encoder_factory=factory, encoder_replicas=replicas)
            serve.run(app, name="scale", route_prefix="/", logging_config=QUIET)
            url = ingress_url(ports)
            bodies = cpu_bodies(opts.scale_requests + 8, opts.seed * 10 + i, "Look")
            asyncio.run(closed_loop(url, bodies[:8], 8, opts.timeout))  # warm-up: every replica's first images
            roots = cluster.processes()
            llm = serve.get_deployment_handle("LLM", "scale")
            steps0, before = llm.stats.remote().result()["step_cpu_s"], proc_cpu.snapshot(roots)
            started = time.perf_counter()
            results = asyncio.run(closed_loop(url, bodies[8:], opts.scale_concurrency, opts.timeout))
            wall = time.perf_counter() - started
            cpu = proc_cpu.cpu_by_role(before, proc_cpu.snapshot(roots))
            steps = llm.stats.remote().result()["step_cpu_s"] - steps0
            r = raw.setdefault(replicas, {"images": 0, "wall": 0.0, "failed": 0, "cpu": {}, "steps": 0.0})
            r["images"] += sum(x.ok for x in results) * len(CPU_SIZES)
            r["wall"] += wall
            r["failed"] += sum(not x.ok for x in results)
            r["cpu"], r["steps"] = _add(r["cpu"], cpu), r["steps"] + steps
            serve.delete("scale")
    for replicas in opts.scale_replicas:
        r = raw[replicas]
        n = max(r["images"], 1)
        out[replicas] = {
            "images_per_s": r["images"] / r["wall"],
            "failed": r["failed"],
            "cpu_ms_per_image": _per(r["cpu"], n),
            "engine_steps_ms_per_image": r["steps"] * 1000 / n,
            "tier_own_ms_per_image": (sum(r["cpu"].values()) - r["steps"]) * 1000 / n,
        }
    return out


def family_phase(cluster: PinnedNodes, opts, ports: list[int], out_dir: Path) -> dict:
    """Per family (`--families`), the tier layout's CPU per image, fresh and cached (the same phase as the layouts'),
    its passes alternating A B, B A, ...; and the bytes of the three images' embeddings as an Encoder returns them
    (the family's tower run here, on the CPU in float32, as the tier's replicas run it)."""
    checkpoints = {f: bench_checkpoint(out_dir, FAMILY_CHECKPOINTS[f], f) for f in opts.families}
    passes: dict[str, list[dict]] = {}
    order = [f for r in range(opts.rounds) for f in (opts.families if r % 2 == 0 else opts.families[::-1])]
    for k, family in enumerate(order):
        print(f"family {family}: pass {len(passes.get(family, [])) + 1} ({k + 1}/{len(order)})", flush=True)
        seed = opts.seed + 500 + 1000 * k
        layout = LAYOUTS["tier"]
        passes.setdefault(family, []).append(run_layout(cluster, layout, checkpoints[family], opts, ports, seed, False))
    return {
        family: {"cpu": {w: pool_cpu([r["cpu"][w] for r in runs]) for w in ("miss", "hit")}}
        | embedding_bytes(checkpoints[family])
        for family, runs in passes.items()
    }


def embedding_bytes(checkpoint: Path) -> dict:
    """Tokens and embedding bytes per image, averaged over the CPU phase's three sizes, from the family's own tower."""
    import torch
    from PIL import Image

    from encoders import ModelSpec

    spec = ModelSpec.load(checkpoint, device="cpu", dtype="float32")
    encoder = spec.family.encoder(checkpoint, device="cpu", dtype=torch.float32, config=spec.hf_config)
    with torch.no_grad():
        embeds = encoder.encode([Image.new("RGB", size) for size in CPU_SIZES])
    n = len(CPU_SIZES)
    return {
        "tokens_per_image": sum(e.shape[0] for e in embeds) / n,
        "width": embeds[0].shape[1],
        "bytes_per_image": sum(e.nbytes for e in embeds) / n,
    }


QUIET = {"log_level": "WARNING", "enable_access_log": False}


def _per(cpu: dict[str, float], images: int) -> dict[str, float]:
    """CPU seconds by process -> ms per image, the largest first."""
    return {role: s * 1000 / images for role, s in sorted(cpu.items(), key=lambda kv: -kv[1])}


def _free() -> int:
    from demo.local import free_port

    return free_port()


PORTS = 16  # the Ingress replica's own ports: a new one binds the next while the last one's lingers


def _cluster_env() -> tuple[dict[str, str], list[int]]:
    """`make serve`'s environment (direct ingress), the Ingress replicas' own ports in a range of free ones."""
    first = _free()
    while not all(_is_free(p) for p in range(first, first + PORTS)):
        first = _free()
    ports = list(range(first, first + PORTS))
    door = {
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(first),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(first + PORTS),
    }
    return serve_env("direct") | door, ports


def _is_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ingress_url(ports: list[int], deadline_s: float = 300) -> str:
    """The URL of the Ingress replica that answers /health (the app's one), once it does."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for port in ports:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return f"http://127.0.0.1:{port}"
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    raise RuntimeError(f"no Ingress replica answered on ports {ports[0]}-{ports[-1]} in {deadline_s:.0f} s")


# ---- Report --------------------------------------------------------------------------------------------------------


def _ms(agg: dict, key: str, pct: str) -> str:
    v = agg[key][pct]
    return "-" if v is None else f"{v:.0f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _at(results: dict, name: str, rate: float) -> dict | None:
    return next((r for r in results.get(name, {}).get("rates", []) if r["rate"] == rate), None)


def _layouts_report(results: dict, names: list[str], opts) -> list[str]:
    """The layouts' tables: CPU per image, then traffic at each rate, and goodput."""
    lines: list[str] = []
    lines.append(
        f"Each layout {opts.rounds} passes, in the order A B C, C B A, ...; the passes pooled. CPU ms per image, all "
        "processes (by process), 3 fresh images a request, max_tokens 1, c=16; hits: the same images again:"
    )
    lines.append(f"{'layout':10} {'pass':5} {'img/s':>6} {'total':>6}  by process")
    for name in names:
        for which in ("miss", "hit"):
            c = results[name]["cpu"][which]
            parts = ", ".join(f"{role} {ms:.1f}" for role, ms in c["cpu_ms_per_image"].items() if ms >= 0.1)
            lines.append(f"{name:10} {which:5} {c['images_per_s']:6.1f} {c['total_ms_per_image']:6.1f}  {parts}")
    lines += [
        "",
        f"traffic: {opts.text_streams} text streams ({opts.text_tokens} tokens a request, closed loop) throughout, "
        f"{opts.unloaded_s:g} s alone, then image requests (Poisson, {opts.window_s:g} s at each rate): 1-4 images of "
        f"{SMALL[0]}x{SMALL[1]} or {LARGE[0]}x{LARGE[1]}, {opts.image_tokens} tokens. Goodput: requests/s (text and "
        f"image) with TTFT <= {opts.ttft_bound:g} s and TPOT <= {opts.tpot_bound * 1000:g} ms; `good`: their share. "
        f"Goodput: the image rate at which {opts.attainment:.0%} are good. Text TPOT unloaded "
        "p50/p99 (ms): "
        + ", ".join(
            f"{n} {_ms(results[n]['text_unloaded'], 'tpot_ms', 'p50')}/"
            f"{_ms(results[n]['text_unloaded'], 'tpot_ms', 'p99')}"
            for n in names
        ),
        f"{'layout':10} {'rate':>5} {'img TTFT p50':>12} {'p99':>6} {'text TPOT p50':>13} {'p99':>5} {'p99/unl':>8} "
        f"{'out tok/s':>9} {'img/s':>6} {'good':>5} {'good/s':>7} {'failed':>6} {'prefill':>7}  cores by process@cpu",
    ]
    for name in names:
        unl = results[name]["text_unloaded"]["tpot_ms"]["p99"]
        for r in results[name]["rates"]:
            ratio = _ratio(r["text"]["tpot_ms"]["p99"], unl)
            failed = r["image"]["failed"] + r["text"]["failed"]
            cores = ", ".join(f"{k} {v:.2f}" for k, v in r["cores_by_process"].items() if v >= 0.02)
            prefill = "/".join(f"{x:.0%}" for x in r["prefill_share"])
            lines.append(
                f"{name:10} {r['rate']:5.2f} {_ms(r['image'], 'ttft_ms', 'p50'):>12} "
                f"{_ms(r['image'], 'ttft_ms', 'p99'):>6} "
                f"{_ms(r['text'], 'tpot_ms', 'p50'):>13} {_ms(r['text'], 'tpot_ms', 'p99'):>5} {_x(ratio):>8} "
                f"{r['out_tok_per_s']:9.1f} {r['images_per_s']:6.2f} {r['good_share']:5.0%} "
                f"{r['goodput_req_per_s']:7.2f} {failed:>6} {prefill:>7}  {cores}"
            )
    lines.append(
        f"goodput, image requests a second with {opts.attainment:.0%} of requests good: "
        + ", ".join(f"{n} {results[n]['goodput_rate']:.2f}" for n in names)
    )
    return lines


def report(results: dict, scale: dict, opts, header: str) -> tuple[str, str]:
    lines = [header, ""]
    names = [n for n in LAYOUTS if n in results]
    if names:
        lines += _layouts_report(results, names, opts)
    if scale:
        lines += [
            "",
            f"scale-out: the ViT a sleep ({opts.scale_image_s:g} s a {SMALL[0]}x{SMALL[1]} image, the others by their "
            f"cost), the tests' tiny LM, requests of 3 fresh images ({', '.join(f'{w}x{h}' for w, h in CPU_SIZES)}), "
            f"max_tokens 1, {opts.scale_concurrency} in flight; the tier's own CPU: every process less the engine's "
            "steps",
            f"{'replicas':>8} {'img/s':>6} {'x one':>6} {'own ms/img':>10} {'steps':>6}  by process (ms an image)",
        ]
        one = scale[min(scale)]["images_per_s"]
        for k, sc in scale.items():
            parts = ", ".join(f"{role} {ms:.1f}" for role, ms in sc["cpu_ms_per_image"].items() if ms >= 0.1)
            lines.append(
                f"{k:8} {sc['images_per_s']:6.1f} {sc['images_per_s'] / one:5.2f}x {sc['tier_own_ms_per_image']:10.1f} "
                f"{sc['engine_steps_ms_per_image']:6.1f}  {parts}"
            )
    a = b = c = d = None
    if "tier" in results and "colocated" in results:
        a = _ratio(*(results[n]["cpu"]["miss"]["total_ms_per_image"] for n in ("tier", "colocated")))
    if scale and 4 in scale and 1 in scale:
        b = scale[4]["images_per_s"] / scale[1]["images_per_s"]
    if "tier" in results:
        if (at := _at(results, "tier", opts.judged_rate)) is not None:
            c = _ratio(at["text"]["tpot_ms"]["p99"], results["tier"]["text_unloaded"]["tpot_ms"]["p99"])
        if "dp2" in results:
            d = _ratio(results["tier"]["goodput_rate"], results["dp2"]["goodput_rate"])
    last = f"tier: cpu/image tier/colocated {_x(a)}; images/s 4 replicas/1 {_x(b)}; TPOT p99 loaded/unloaded {_x(c)}; "
    last += f"goodput tier/DP2 {_x(d)}"
    return "\n".join(lines), last


def family_report(families: dict) -> tuple[str, str]:
    """The families' table (tier layout, CPU ms per image and embedding bytes per image) and its line of ratios."""
    if not families:
        return "", ""
    lines = [
        "",
        "families, the tier layout (as above: 3 fresh images a request, then hits); tokens and embedding bytes per "
        "image: the Encoder's output for those three sizes, float32",
        f"{'family':10} {'pass':5} {'img/s':>6} {'total':>6} {'tokens':>6} {'width':>5} {'KB/img':>7}  by process",
    ]
    for name, f in families.items():
        for which in ("miss", "hit"):
            c = f["cpu"][which]
            parts = ", ".join(f"{role} {ms:.1f}" for role, ms in c["cpu_ms_per_image"].items() if ms >= 0.1)
            lines.append(
                f"{name:10} {which:5} {c['images_per_s']:6.1f} {c['total_ms_per_image']:6.1f} "
                f"{f['tokens_per_image']:6.1f} {f['width']:5} {f['bytes_per_image'] / 1000:7.1f}  {parts}"
            )
    last = ""
    if "qwen2_vl" in families and "qwen3_vl" in families:
        a, b = families["qwen3_vl"], families["qwen2_vl"]
        cpu = _ratio(a["cpu"]["miss"]["total_ms_per_image"], b["cpu"]["miss"]["total_ms_per_image"])
        last = (
            f"families: tier cpu/image qwen3_vl/qwen2_vl {_x(cpu)}; "
            f"bytes/image {_x(_ratio(a['bytes_per_image'], b['bytes_per_image']))}"
        )
    return "\n".join(lines), last


def plot(path: Path, results: dict, scale: dict, title: str) -> None:
    """Image TTFT p99, text TPOT p99 and goodput against the image rate, one line a layout; scale-out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for name in (n for n in LAYOUTS if n in results):
        rates = [r["rate"] for r in results[name]["rates"]]
        axes[0].plot(rates, [r["image"]["ttft_ms"]["p99"] for r in results[name]["rates"]], marker="o", label=name)
        axes[1].plot(rates, [r["text"]["tpot_ms"]["p99"] for r in results[name]["rates"]], marker="o", label=name)
        axes[2].plot(rates, [r["good_share"] * 100 for r in results[name]["rates"]], marker="o", label=name)
    labels = ("image TTFT p99 (ms)", "text streams' TPOT p99 (ms)", "requests meeting both bounds (%)")
    for ax, ylabel in zip(axes[:3], labels, strict=True):
        ax.set_xlabel("image requests / s")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0].set_yscale("log")
    axes[1].set_ylim(bottom=0)
    axes[2].set_ylim(bottom=0)
    if scale:
        ks = sorted(scale)
        axes[3].plot(ks, [scale[k]["images_per_s"] for k in ks], marker="o", label="measured")
        axes[3].plot(ks, [scale[ks[0]]["images_per_s"] * k / ks[0] for k in ks], ls="--", label="linear")
        axes[3].set_xticks(ks)
        axes[3].set_xlabel("Encoder replicas (the ViT a sleep)")
        axes[3].set_ylabel("images / s")
        axes[3].legend()
        axes[3].grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tier", description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="tier,tier1,colocated,dp2", help=f"of {', '.join(LAYOUTS)} (comma-separated)")
    p.add_argument("--cache-gib", type=float, default=0.5, help="encoder.cache_gib")
    p.add_argument("--cpu-requests", type=int, default=24, help="requests of 3 images in the CPU phase, each pass")
    p.add_argument("--text-streams", type=int, default=3)
    p.add_argument("--text-tokens", type=int, default=48, help="output tokens of each text request")
    p.add_argument("--image-tokens", type=int, default=16, help="output tokens of each image request")
    p.add_argument("--rates", default="0.2,0.4,0.6,0.8,1.0", help="image requests per second, one window each")
    p.add_argument("--unloaded-s", type=float, default=15.0)
    p.add_argument("--window-s", type=float, default=30.0, help="seconds of image requests at each rate")
    p.add_argument("--ttft-bound", type=float, default=2.0, help="goodput: TTFT at most this (s)")
    p.add_argument("--tpot-bound", type=float, default=0.05, help="goodput: TPOT at most this (s): reading speed")
    p.add_argument("--judged-rate", type=float, default=0.6, help="the rate of the last line's TPOT ratio (issue 51's)")
    p.add_argument("--llm-args", type=json.loads, default={}, help="JSON merged into every layout's llm args")
    p.add_argument("--attainment", type=float, default=0.9, help="goodput: the share of requests within both bounds")
    p.add_argument("--scale-replicas", default="1,2,4", help="Encoder replicas of the scale-out runs ('' skips it)")
    p.add_argument("--scale-requests", type=int, default=160)
    p.add_argument("--scale-concurrency", type=int, default=32)
    p.add_argument("--scale-image-s", type=float, default=0.125, help="the scale-out ViT's sleep for one image")
    p.add_argument(
        "--families", default="qwen2_vl,qwen3_vl", help="the tier's CPU and bytes per image of each ('' skips)"
    )
    p.add_argument("--rounds", type=int, default=2, help="passes of each layout, in the order A B C, C B A, ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out-dir", default="bench_results")
    opts = p.parse_args(argv)
    opts.scale_replicas = [int(k) for k in opts.scale_replicas.split(",") if k]
    opts.rates = [float(r) for r in opts.rates.split(",") if r]
    opts.families = [f for f in opts.families.split(",") if f]
    if unknown := set(opts.families) - set(FAMILY_CHECKPOINTS):
        raise SystemExit(f"--families: {sorted(unknown)}; known: {sorted(FAMILY_CHECKPOINTS)}")
    out_dir = Path(opts.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("bench-tier pins two nodes to a core each: it needs 2 CPUs")
    checkpoint = bench_checkpoint(out_dir, TIER_CHECKPOINT)
    chosen = [LAYOUTS[n] for n in opts.layouts.split(",") if n]
    results: dict[str, dict] = {}
    families: dict[str, dict] = {}
    if chosen or opts.families:
        from ray import serve

        env, ports = _cluster_env()
        with PinnedNodes(["0", "1"], env) as cluster:
            cluster.connect()
            serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": _free()})
            # Each layout `--rounds` times, in the order A B C, C B A, ...: a machine whose speed drifts (a shared VM's
            # does, by tens of percent over minutes) weighs every layout alike; the passes are pooled.
            order = [layout for r in range(opts.rounds) for layout in (chosen if r % 2 == 0 else chosen[::-1])]
            passes: dict[str, list[dict]] = {}
            for k, layout in enumerate(order):
                print(f"{layout.name}: pass {len(passes.get(layout.name, [])) + 1} ({k + 1}/{len(order)})", flush=True)
                seed = opts.seed + 1000 * k  # fresh images every pass: no embedding cache hit across passes
                passes.setdefault(layout.name, []).append(run_layout(cluster, layout, checkpoint, opts, ports, seed))
            results = {name: merge(runs, opts) for name, runs in passes.items()}
            families = family_phase(cluster, opts, ports, out_dir) if opts.families else {}
    scale = scale_out(opts, out_dir) if opts.scale_replicas else {}
    stamp = datetime.now(UTC)
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    header = (
        f"{stamp.isoformat(timespec='seconds')}  {cpu}, {os.cpu_count()} cores  commit {commit()}  "
        f"{platform.python_version()}; nodes pinned to cores 0 and 1 (tier: LLM and ingress on 0, Encoder on 1); "
        f"checkpoint {checkpoint.name}: LM hidden {TIER_CHECKPOINT['hidden_size']} x {TIER_CHECKPOINT['num_layers']}, "
        f"ViT {TIER_CHECKPOINT['vision_embed_dim']} x {TIER_CHECKPOINT['vision_depth']}"
        + (f"; llm args {json.dumps(opts.llm_args)}" if opts.llm_args else "")
    )
    text, last = report(results, scale, opts, header)
    family_text, family_last = family_report(families)
    print(text + family_text)
    path = out_dir / f"tier-{stamp.strftime('%Y%m%d-%H%M%S')}.json"
    data = {"opts": vars(opts), "results": results, "scale": scale, "families": families}
    path.write_text(json.dumps(data, indent=1, default=str))
    if results or scale:
        plot(path.with_suffix(".png"), results, scale, header)
    print(f"wrote {path}" + (f" and {path.with_suffix('.png')}" if results or scale else ""))
    if family_last:
        print(family_last)
    print(last)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
