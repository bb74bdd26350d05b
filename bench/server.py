"""The bench checkpoint (built once, cached by its parameters) and our app on an in-process Ray Serve."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from demo.local import free_port, merge_args

# A bench-size random Qwen2-VL: ~26M parameters, big enough that compute dominates per-request overheads.
# init_std is small so activations stay sane over 8 layers; output quality is irrelevant (lengths are forced).
CHECKPOINT_PARAMS: dict = dict(
    seed=0, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408,
    vision_embed_dim=128, vision_depth=4, vision_heads=4, init_std=0.02, max_pixels=224 * 224,
)  # fmt: skip


def bench_checkpoint(root: Path, params: dict = CHECKPOINT_PARAMS, family: str = "qwen2_vl") -> Path:
    """root/ckpt-<hash of family and params>, a random Qwen2-VL (or "qwen3_vl": Qwen3-VL) checkpoint; built next to
    it and renamed, so a half-written one never looks complete."""
    from transformers.utils import logging as hf_logging

    from demo.build_tiny import build_checkpoint
    from demo.tiny_qwen3_vl import build_qwen3_vl_checkpoint

    build = {"qwen2_vl": build_checkpoint, "qwen3_vl": build_qwen3_vl_checkpoint}[family]
    named = params if family == "qwen2_vl" else {**params, "family": family}  # the Qwen2-VL ones keep their names
    key = hashlib.sha256(json.dumps(named, sort_keys=True).encode()).hexdigest()[:12]
    out = root / f"ckpt-{key}"
    if all((out / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")):
        return out
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".ckpt-{key}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    hf_logging.disable_progress_bar()
    try:
        build(staging, **params)
        (staging / "bench_params.json").write_text(json.dumps(params, indent=1, sort_keys=True))
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def wait_healthy(base_url: str, deadline_s: float) -> None:
    """serve.run returns once replicas are up; the proxy's route table can lag behind it by a moment."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"{base_url}/health did not answer 200 within {deadline_s:.0f}s")
        time.sleep(0.5)


@contextmanager
def ray_serve(num_cpus: int = 4, ingress: str = "proxy", metrics_port: int | None = None) -> Iterator[int]:
    """Ray + Serve in this process, HTTP on a free port; always shut down, even when the run fails. `ingress`: Serve's
    front door as `make serve INGRESS=...` opens it (proxy, direct or haproxy); the port yielded is the one clients
    use (under direct, the Ingress replica's own). `metrics_port`: Prometheus metrics there, reported every second."""
    import ray
    from ray import serve

    from demo.local import ingress_ports, serve_env

    # NOTE: as tests/conftest.py: Serve's default proxy readiness checks (5 s / 10 s) kill the
    # proxy on a loaded 2-core machine; the controller reads these from the driver's environment at ray.init.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
    port = free_port()
    client_port, door_env, _ = ingress_ports(ingress, port)
    os.environ.update(serve_env(ingress) | door_env)  # NOTE: before ray.init: every process Ray starts reads them
    metrics = {} if metrics_port is None else {"_metrics_export_port": metrics_port}
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        logging_level="warning",
        _system_config={"metrics_report_interval_ms": 1000} if metrics_port else None,
        **metrics,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=QUIET)
        yield client_port
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


QUIET = {"log_level": "WARNING", "enable_access_log": False}  # per-request INFO lines would drown the report


@contextmanager
def serve_app(
    checkpoint: Path,
    *,
    max_images: int,
    max_model_len: int = 4096,
    overrides: dict | None = None,
    ingress: str = "proxy",
) -> Iterator[str]:
    """Our app at route / of an in-process Ray Serve (`ray_serve`), behind the front door `ingress`."""
    from ray import serve

    from deployments.app import build_app

    with ray_serve(ingress=ingress) as port:
        args = merge_args(
            {
                "model": str(checkpoint),
                "llm": {"max_model_len": max_model_len},
                "limits": {"max_images_per_request": max(8, max_images)},
            },
            overrides or {},
        )
        serve.run(build_app(args), name="bench", route_prefix="/", logging_config=QUIET)
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, 120)
        yield base_url


def served_model_name(base_url: str) -> str:
    return httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
