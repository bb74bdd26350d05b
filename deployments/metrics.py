"""Prometheus metrics of the app, through `ray.serve.metrics`; Ray's metrics agent exports them as `ray_vlm_*`.

Names follow vLLM's (`vllm:time_to_first_token_seconds` -> `vlm_time_to_first_token_seconds`); Ray deprecates the
colon, so the prefix is `vlm_`. Serve adds the deployment, replica and application tags."""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import os
from collections.abc import Callable
from typing import Any

from ray.serve.metrics import Counter, Gauge, Histogram

logger = logging.getLogger("ray.serve")
LATENCY_S = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


class IngressMetrics:
    def __init__(self) -> None:
        self.ttft = Histogram(
            "vlm_time_to_first_token_seconds",
            "Request arrival to its first token (images encoded, prompt prefilled).",
            boundaries=LATENCY_S,
        )
        self.e2e = Histogram(
            "vlm_e2e_request_latency_seconds", "Request arrival to its last token.", boundaries=LATENCY_S
        )
        self.responses = Counter(
            "vlm_requests_total", "Requests answered, by HTTP status (errors: 4xx, 5xx).", tag_keys=("status",)
        )
        self.images = Counter("vlm_request_images_total", "Images received in requests.")
        self.videos = Counter("vlm_request_videos_total", "Videos received in requests.")
        self.video_frames = Counter("vlm_video_frames_sampled_total", "Frames sampled from the requests' videos.")
        self.video_tokens = Counter("vlm_video_tokens_total", "Prompt tokens of the requests' videos.")
        self.video_probe = Histogram(
            "vlm_video_probe_seconds", "Reading a video's container at the ingress.", boundaries=LATENCY_S
        )
        # The embedding cache (deployments/ingress/generate.py `EmbeddingRefs`): each image, or chunk of a video,
        # looked up
        self.cache_queries = Counter("vlm_embedding_cache_queries_total", "Embedding cache lookups.")
        self.cache_hits = Counter("vlm_embedding_cache_hits_total", "Embedding cache lookups that found the image.")

    def on_videos(self, stats: list[tuple[int, int, float]]) -> None:
        """(sampled frames, tokens, probe seconds) of each video of a request."""
        for frames, tokens, probe_s in stats:
            self.videos.inc()
            self.video_frames.inc(frames)
            self.video_tokens.inc(tokens)
            self.video_probe.observe(probe_s)


class EncoderMetrics:
    def __init__(self) -> None:
        self.latency = Histogram("vlm_encoder_latency_seconds", "One batched encoder forward.", boundaries=LATENCY_S)
        self.batch_size = Histogram("vlm_encoder_batch_size", "Images in one encoder forward.", boundaries=BATCH_SIZES)
        self.images = Counter("vlm_images_encoded_total", "Images run through the vision encoder.")
        self.cancelled = Counter("vlm_encoder_cancelled_total", "Image encodings cancelled (client left).")
        # The cost of encoder work (encoders/cost.py) as the router and the autoscaler see it.
        self.pending_cost = Gauge("vlm_encoder_pending_cost_gflop", "GFLOP of images queued and running here.")
        self.cost = Counter("vlm_encoder_cost_gflop_total", "GFLOP of the images that arrived.")
        self.video_decode = Histogram(
            "vlm_video_decode_seconds", "Decoding a video's (or chunk's) sampled frames.", boundaries=LATENCY_S
        )
        # A replica's start, phase by phase (deployments/replica.py): what a scale-up waits for
        self.start = Gauge(
            "vlm_encoder_start_seconds",
            "Seconds each phase of this replica's start took, from its process's start to its first image.",
            tag_keys=("phase",),
        )
        self.serving_since = Gauge(
            "vlm_encoder_serving_since_timestamp_seconds",
            "When this replica served its first image (seconds since the epoch, as process_start_time_seconds).",
        )

    def on_started(self, timeline: Any) -> None:
        """`timeline`: a StartTimeline whose first image has been served."""
        for phase, seconds in timeline.durations().items():
            self.start.set(seconds, tags={"phase": phase})
        self.serving_since.set(timeline.events["first_image"])

    def on_batch(self, num_images: int, seconds: float) -> None:
        self.latency.observe(seconds)
        self.batch_size.observe(num_images)
        self.images.inc(num_images)


class LLMMetrics:
    """Gauges and counters from the engine's stats, sampled every `interval_s`; queue times and inter-token
    latencies drained from the engine's bounded buffers."""

    def __init__(
        self,
        engine_stats: Callable[[], dict[str, float]],
        drain: Callable[[], tuple[list, list]],
        interval_s: float = 1.0,
    ) -> None:
        self.engine_stats, self.drain, self.interval_s = engine_stats, drain, interval_s
        self.running = Gauge("vlm_num_requests_running", "Sequences in the engine's running batch.")
        self.waiting = Gauge("vlm_num_requests_waiting", "Sequences waiting for the engine (KV cache or batch full).")
        self.kv_usage = Gauge("vlm_kv_cache_usage_perc", "Share of KV-cache blocks held by sequences (0..1).")
        self.prefix_queries = Counter("vlm_prefix_cache_queries_total", "Prompt blocks looked up for prefix reuse.")
        self.prefix_hits = Counter("vlm_prefix_cache_hits_total", "Prompt blocks whose KV was reused.")
        self.preemptions = Counter("vlm_num_preemptions_total", "Sequences preempted for KV-cache space.")
        self.queue_time = Histogram(
            "vlm_request_queue_time_seconds", "Arrival in the engine to first scheduled.", boundaries=LATENCY_S
        )
        self.itl = Histogram(
            "vlm_inter_token_latency_seconds", "Time between two tokens of a sequence.", boundaries=LATENCY_S
        )
        self._last: dict[str, float] = {}

    def sample(self) -> None:
        stats = self.engine_stats()
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.kv_usage.set(stats["kv_usage"])
        for name, counter in (
            ("prefix_queries", self.prefix_queries),
            ("prefix_hits", self.prefix_hits),
            ("preemptions", self.preemptions),
        ):
            if (delta := stats[name] - self._last.get(name, 0)) > 0:
                counter.inc(delta)
            self._last[name] = stats[name]
        queue_times, itls = self.drain()
        for value in queue_times:
            self.queue_time.observe(value)
        for value in itls:
            self.itl.observe(value)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.sample()
            except Exception:  # metrics never take the replica down
                logger.warning("could not sample engine metrics", exc_info=True)


def heap_census() -> dict[str, Any]:
    """This process's pid and how many objects Python's collector tracks: a leak grows the count with the resident
    memory, fragmentation only the memory (the soak samples both, bench/soak_probe.py). Takes milliseconds. In a
    replica these are the objects made since it started: Serve freezes what its start made (gc.freeze), and frozen
    objects are not listed."""
    gc.collect()  # cycles a collection would free (exceptions and their tracebacks, mostly) are not a leak
    objects = gc.get_objects()
    top = collections.Counter(type(o).__qualname__ for o in objects).most_common(8)
    return {"pid": os.getpid(), "python_objects": len(objects), "top_types": dict(top)}


__all__ = ["EncoderMetrics", "IngressMetrics", "LLMMetrics", "heap_census"]
