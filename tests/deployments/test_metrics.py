"""The Prometheus metrics an operator reads, scraped from Ray's metrics endpoint after real requests."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from demo.inputs import data_url, make_image, make_video, video_url

pytestmark = pytest.mark.e2e


def _scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def _total(samples, name: str, **labels: str) -> float:
    """Sum over the app's replicas of one series (exported by Ray as ray_<name>)."""
    want = {"application": "vlm", **labels}
    return sum(v for n, lab, v in samples if n == f"ray_{name}" and want.items() <= lab.items())


def _grown(before, after, name: str, **labels: str) -> float:
    return _total(after, name, **labels) - _total(before, name, **labels)


COUNTS = [
    "vlm_time_to_first_token_seconds_count",
    "vlm_e2e_request_latency_seconds_count",
    "vlm_inter_token_latency_seconds_count",
    "vlm_request_queue_time_seconds_count",
    "vlm_encoder_latency_seconds_count",
    "vlm_encoder_batch_size_count",
    "vlm_images_encoded_total",
    "vlm_encoder_cost_gflop_total",
    "vlm_embedding_cache_queries_total",
    "vlm_request_images_total",
    "vlm_prefix_cache_queries_total",
]


def _grown_enough(grown: dict[str, float]) -> bool:
    """What two 200s (6 tokens each, one image each, the second a cache hit) and one 400 must add."""
    return (
        all(grown[name] > 0 for name in COUNTS)
        and grown["200"] >= 2
        and grown["400"] >= 1
        and grown["hits"] >= 1
        and grown["vlm_time_to_first_token_seconds_count"] >= 2
        and grown["vlm_request_images_total"] >= 2
        and grown["vlm_inter_token_latency_seconds_count"] >= 2 * 5  # 6 tokens: 5 gaps, per request
    )


def test_requests_show_in_the_metrics(client, metrics_port):
    before = _scrape(metrics_port)
    image = {"type": "image_url", "image_url": {"url": data_url(make_image(84, 56, seed=int(time.time())))}}
    body = {
        "messages": [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert client.post("/v1/chat/completions", json={**body, "stream": True}).status_code == 200  # a cache hit
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400
    # Each replica exports on its own clock, so wait for every count the requests imply, not just for some growth.
    deadline, grown = time.monotonic() + 30, {}
    while time.monotonic() < deadline:
        after = _scrape(metrics_port)
        grown = {name: _grown(before, after, name) for name in COUNTS}
        grown |= {status: _grown(before, after, "vlm_requests_total", status=status) for status in ("200", "400")}
        grown["hits"] = _grown(before, after, "vlm_embedding_cache_hits_total")
        if _grown_enough(grown):
            break
        time.sleep(0.5)
    assert _grown_enough(grown), grown
    names = {n for n, lab, _ in after if lab.get("application") == "vlm"}
    for gauge in ("vlm_num_requests_running", "vlm_num_requests_waiting", "vlm_kv_cache_usage_perc"):
        assert f"ray_{gauge}" in names
    assert 0.0 <= _total(after, "vlm_kv_cache_usage_perc") <= 1.0


def test_videos_show_in_the_metrics(client, metrics_port):
    """A video of 24 frames at 8 fps: 6 frames sampled (12 tokens each pair at these pixel bounds), probed once,
    decoded once (a new video each run: no cache hit)."""
    names = ["vlm_request_videos_total", "vlm_video_frames_sampled_total", "vlm_video_tokens_total",
             "vlm_video_probe_seconds_count", "vlm_video_decode_seconds_count"]  # fmt: skip
    video = make_video(3, fps=8, width=160, height=120, seed=int(time.time()) % 10_000)
    part = {"type": "video_url", "video_url": {"url": video_url(video)}}
    body = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}], "max_tokens": 2,
            "mm_processor_kwargs": {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16}}  # fmt: skip
    before = _scrape(metrics_port)
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    deadline, grown = time.monotonic() + 30, {}
    while time.monotonic() < deadline:
        after = _scrape(metrics_port)
        grown = {name: _grown(before, after, name) for name in names}
        if all(v > 0 for v in grown.values()):
            break
        time.sleep(0.5)
    assert grown == dict(zip(names, [1, 6, 36, 1, 1])), grown


def test_an_encoder_replica_exports_its_start_phase_by_phase(client, metrics_port):
    """Once it served an image, each Encoder replica exports how long each phase of its start took, and when it began
    serving: what a scale-up waits for (deployments/replica.py's StartTimeline)."""
    image = {"type": "image_url", "image_url": {"url": data_url(make_image(60, 44, seed=int(time.time()) + 1))}}
    body = {"messages": [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}], "max_tokens": 1}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    deadline, phases, since = time.monotonic() + 30, {}, []
    while time.monotonic() < deadline:
        samples = _scrape(metrics_port)
        mine = [(n, lab, v) for n, lab, v in samples if lab.get("application") == "vlm"]
        phases = {lab["phase"]: v for n, lab, v in mine if n == "ray_vlm_encoder_start_seconds"}
        since = [v for n, _, v in mine if n == "ray_vlm_encoder_serving_since_timestamp_seconds"]
        if len(phases) == 6 and since:
            break
        time.sleep(0.5)
    assert set(phases) == {"process", "imports", "waiting", "model", "check", "first_image"}, phases
    assert all(v >= 0 for v in phases.values()) and 0 < sum(phases.values()) < 600
    assert all(time.time() - 3600 < v <= time.time() for v in since)
