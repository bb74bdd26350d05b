"""A running application for end-to-end tests: Ray Serve started once, requests over real HTTP."""

from __future__ import annotations

import os

import httpx
import pytest
import ray
from ray import serve

from deployments import build_app
from tests.helpers import free_port

# Small limits so that every limit can be hit cheaply.
LIMITS = {"max_request_bytes": 2 << 20, "max_image_pixels": 640 * 640, "max_images_per_request": 4,
          "default_max_tokens": 16}


@pytest.fixture(scope="session")
def ray_serve():
    port = free_port()
    # NOTE: Serve's proxy readiness checks (5 s / 10 s) kill the proxy on a loaded 2-core CI machine; the
    # controller inherits these from the driver's environment at ray.init.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
    # address="local": always a fresh cluster of our own, never one a `ray start` left running on this machine
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def app_args(checkpoint) -> dict:
    return {"model": str(checkpoint), "limits": LIMITS, "llm": {"max_model_len": 1024}}


@pytest.fixture(scope="session")
def base_url(ray_serve, app_args) -> str:
    serve.run(build_app(app_args), name="vlm", route_prefix="/")
    return ray_serve


@pytest.fixture
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c
