"""`make bench-video`: a long video across the encoder tier (issue 23's row). A 60 s 320x240 h264 video, made here
with PyAV and sampled as Qwen does (fps 2: 120 frames, 60 tubelets), streamed through the app as `make serve` runs it
on the bench checkpoint, one request at a time, with 1 Encoder replica and then with 2: time to first token. Then,
in this process, what that time is made of: the container probe, each chunk's decoding process, and the ViT.
Prints the tables and, last, the ratio of TTFT with 2 replicas to 1.

The bench checkpoint's context is 4096 tokens, so the frames are capped at 224x168 (48 tokens a tubelet, 2880 for
the video; a 2B checkpoint's default budget would give 392x280 and 8400), and encoder.max_batch_patches is 4096, so
that the video goes to the tier in three chunks, as the 8400-token one does at serve_config.yaml's 16384."""

from __future__ import annotations

import argparse
import io
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.client import load

SECONDS, FPS, WIDTH, HEIGHT = 60, 24, 320, 240
KW = {"min_pixels": 28 * 28 * 4, "max_pixels": 224 * 168}  # mm_processor_kwargs: 224x168 frames
APP_ARGS = {"encoder": {"max_batch_patches": 4096, "colocated": False}}  # chunks of 21, 21, 18 tubelets of 192 patches
READY = re.compile(r"ServeReplica:vlm:Encoder pid=(\d+)\).*encoder ready")
# Serve's access line of each encoder call: the replica's pid, the request id (every chunk of a request shares it)
CALL = re.compile(r"ServeReplica:vlm:Encoder pid=(\d+)\).* ([0-9a-f-]{36}) -- CALL encode OK ([0-9.]+)ms")


def make_video(seed: int, seconds: int = SECONDS, fps: int = FPS) -> bytes:
    """An h264 mp4: a colour gradient that drifts, and a square that moves across it; `seed` picks the colours and
    the path, so that no two videos share an embedding or a prefix."""
    import av

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH].astype(np.float32)
    tint, speed = rng.uniform(0.3, 1.0, 3), rng.uniform(1.0, 4.0, 2)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"preset": "veryfast"})
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        for i in range(seconds * fps):
            phase = (x + y + 2 * i) % 256  # (H, W)
            frame = np.stack([phase * t for t in tint], -1).astype(np.uint8)  # (H, W, 3)
            cy, cx = int(i * speed[0]) % (HEIGHT - 40), int(i * speed[1]) % (WIDTH - 40)
            frame[cy : cy + 40, cx : cx + 40] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def body(video: bytes, model: str, max_tokens: int) -> dict:
    from demo.inputs import video_url

    part = {"type": "video_url", "video_url": {"url": video_url(video)}}
    return {
        "model": model, "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What happens?"}]}],
        "stream": True, "stream_options": {"include_usage": True}, "temperature": 0, "max_tokens": max_tokens,
        "ignore_eos": True, "return_token_ids": True, "mm_processor_kwargs": KW,
    }  # fmt: skip


def wait_encoders(log: Path, n: int, timeout_s: float) -> None:
    """Until n Encoder replicas have said they are ready in the server's log: the app answers as soon as one is."""
    end = time.monotonic() + timeout_s
    while len(set(READY.findall(log.read_text(errors="replace")))) < n:
        if time.monotonic() > end:
            raise RuntimeError(f"{n} Encoder replicas were not ready within {timeout_s:.0f}s; see {log}")
        time.sleep(1)


def encoder_calls(log: Path) -> list[tuple[float, int]]:
    """(its slowest encoder call in seconds, the Encoder replicas its calls went to) of each request that had any,
    in order, from the server's log."""
    calls: dict[str, list[tuple[str, float]]] = {}
    for pid, request, ms in CALL.findall(log.read_text(errors="replace")):
        calls.setdefault(request, []).append((pid, float(ms) / 1000))
    return [(max(s for _, s in c), len({pid for pid, _ in c})) for c in calls.values()]


def served(ckpt: Path, out_dir: Path, stamp: str, replicas: int, warmup: list[bytes], videos: list[bytes], args):
    """The app with `replicas` Encoder replicas: the warm-up videos, then each video alone; their results, and
    (slowest encoder call, replicas used) of each measured request."""
    from bench import peer_servers
    from bench.server import served_model_name

    deployments = {"Encoder": {"autoscaling_config": {"min_replicas": replicas, "max_replicas": replicas}}}
    env = {"RAY_DEDUP_LOGS": "0"}  # each replica's "encoder ready" line, not one for all (wait_encoders reads them)
    log = out_dir / f"peer-{stamp}-{replicas}-ours.log"
    with peer_servers.ours(ckpt, out_dir, f"{stamp}-{replicas}", APP_ARGS, 600.0, None, env, deployments) as (url, _):
        wait_encoders(log, replicas, 300)
        model = served_model_name(url)
        rs, _ = load(url, [body(v, model, 2) for v in warmup], 1, None, 600)
        assert all(r.ok for r in rs), [r.error for r in rs]
        rs, _ = load(url, [body(v, model, args.output_len) for v in videos], 1, None, 600)
    calls = encoder_calls(log)[-len(videos) :]  # read once the server is down: its log is complete
    for r, (slowest, used) in zip(rs, calls, strict=False):
        print(f"{replicas} encoder replica(s): TTFT {r.ttft:.2f} s, E2E {r.e2e:.2f} s, slowest encoder call "
              f"{slowest:.2f} s on {used} replica(s), {r.error or 'ok'}", flush=True)  # fmt: skip
    return rs, calls


def breakdown(ckpt: Path, video: bytes) -> list[tuple[str, float]]:
    """(step, seconds) in this process, one torch thread: what a request's encoder work is made of, chunk by chunk."""
    from encoders import ModelSpec, Qwen2VLVisionEncoder
    from encoders.video_decode import Video
    from encoders.video_processing import SamplingRequest, VideoMeta
    from encoders.videos import probe_video
    from schemas import AppArgs

    args = AppArgs.model_validate({"model": str(ckpt), **APP_ARGS})
    processing, v = ModelSpec.from_args(args).video_processing, args.video
    t0 = time.perf_counter()
    info = probe_video(video, v, args.limits, "mp4")
    rows = [("probe the container (ingress)", time.perf_counter() - t0)]
    meta = VideoMeta(info.num_frames, info.fps, info.width, info.height)
    plan = processing.plan(meta, SamplingRequest(**KW), v.total_pixels)  # within the checkpoint's bounds
    import torch

    torch.set_num_threads(1)  # as an Encoder replica runs: Ray sets OMP_NUM_THREADS=1 for its 0.4 CPU
    encoder = Qwen2VLVisionEncoder(ckpt)
    encoder.forward([processing.preprocess(Video(video, plan.chunk(0, 1)).decode(60, v.decode_memory_mib))])  # warm-up
    for a, b in [(0, plan.grid_thw[0]), *plan.chunks(args.encoder.max_batch_patches)]:
        part = plan if (a, b) == (0, plan.grid_thw[0]) else plan.chunk(a, b)
        what = "whole video" if part is plan else f"chunk of tubelets {a}-{b}"
        t0 = time.perf_counter()
        frames = Video(video, part).decode(v.decode_timeout_s, v.decode_memory_mib)  # (n, h, w, 3)
        t1 = time.perf_counter()
        pixel_values, grid = processing.preprocess(frames)
        t2 = time.perf_counter()
        encoder.forward([(pixel_values, grid)])
        t3 = time.perf_counter()
        rows += [(f"{what}: decode (frames 0-{part.indices[-1]} of {info.num_frames})", t1 - t0),
                 (f"{what}: preprocess ({len(part.indices)} frames)", t2 - t1),
                 (f"{what}: ViT + projector ({grid[0] * grid[1] * grid[2]} patches)", t3 - t2)]  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.video", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3, help="measured requests per replica count (each a new video)")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--out-dir", default="bench_results")
    args = p.parse_args(argv)
    from bench.report import machine_info
    from bench.server import bench_checkpoint

    out_dir = Path(args.out_dir)
    ckpt = bench_checkpoint(out_dir)
    m = machine_info()
    print(f"{m['date']}  {m['cpu']}, {m['cores']} cores, load average {m['loadavg_at_start']}", flush=True)
    t0 = time.perf_counter()
    warmup, videos = [make_video(1000)], [make_video(seed) for seed in range(args.requests)]
    print(f"{len(videos) + 1} videos of {SECONDS} s, {WIDTH}x{HEIGHT} at {FPS} fps made in "
          f"{time.perf_counter() - t0:.1f} s, {len(videos[0]) / 2**20:.2f} MiB each", flush=True)  # fmt: skip
    stamp = time.strftime("%Y%m%d-%H%M%S")
    served_runs = {n: served(ckpt, out_dir, stamp, n, warmup, videos, args) for n in (1, 2)}
    results = {n: rs for n, (rs, _) in served_runs.items()}
    rows = breakdown(ckpt, videos[0])
    report(results, {n: calls for n, (_, calls) in served_runs.items()}, rows, args.requests)
    return 0 if all(r.ok for rs in results.values() for r in rs) else 1


def _p50(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def report(results: dict[int, list], calls: dict[int, list], rows: list[tuple[str, float]], requests: int) -> None:
    ttft = {n: _p50(r.ttft for r in rs if r.ok) for n, rs in results.items()}
    prompt = next((r.prompt_tokens for rs in results.values() for r in rs if r.ok), 0)
    print(f"\n| {requests} requests, one at a time, {prompt} prompt tokens | TTFT p50 s | TTFT each s | E2E p50 s "
          "| slowest encoder call p50 s | replicas each request used |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for n, rs in results.items():
        ok = [r for r in rs if r.ok]
        each = ", ".join(f"{r.ttft:.2f}" for r in ok)
        used = ", ".join(str(u) for _, u in calls[n])
        print(f"| {n} encoder replica{'s' * (n > 1)} | {ttft[n]:.2f} | {each} | {_p50(r.e2e for r in ok):.2f} | "
              f"{_p50(s for s, _ in calls[n]):.2f} | {used} |")  # fmt: skip
    print("\n| in this process, after the servers | s |\n| --- | --- |")
    for what, seconds in rows:
        print(f"| {what} | {seconds:.2f} |")
    if all(t == t for t in ttft.values()):  # NOTE: NaN where a run had no answer
        ratio = ttft[2] / ttft[1]
        print(f"\nvideo: TTFT p50 with 2 encoder replicas / 1: {ratio:.2f}x ({ttft[2]:.2f} / {ttft[1]:.2f} s)")


if __name__ == "__main__":
    sys.exit(main())
