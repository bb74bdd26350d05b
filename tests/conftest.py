"""Shared fixtures: tiny random Qwen2-VL checkpoints (both layouts), the transformers reference, and the running
application for end-to-end tests (Ray Serve started once, requests over real HTTP)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from demo.build_tiny import build_checkpoint
from demo.inputs import make_image
from demo.local import LIMITS, free_port
from tests.helpers import DEMO_KEY


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built():
    """Build llm/model/cpu_kernels.cpp once, here, before any replica: replicas then load the cached build instead of
    racing to compile it (the first build takes about a minute on 2 cores)."""
    from llm.model import cpu_kernels

    return cpu_kernels.load()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """Hub layout (`visual.*`, `model.*`, `lm_head.*`): what real checkpoints and transformers 5 use."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2-vl-tiny", seed=0, max_pixels=28 * 28 * 64)


@pytest.fixture(scope="session")
def legacy_checkpoint(tmp_path_factory) -> Path:
    """transformers 4.52-4.57 layout (`model.visual.*`, `model.language_model.*`), same weights."""
    return build_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "qwen2-vl-tiny-legacy", seed=0, max_pixels=28 * 28 * 64, layout="legacy"
    )


@pytest.fixture(scope="session")
def reference(checkpoint):
    """transformers' own model on the same weights: the answer we must match."""
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def ray_serve(metrics_port):
    import ray  # NOTE: here, not at the top: the engine's tests (`-m gpu` on a bare GPU machine) run without Ray
    from ray import serve

    port = free_port()
    # NOTE: Serve's proxy readiness checks (5 s / 10 s) kill the proxy on a loaded 2-core CI machine; the
    # controller inherits these from the driver's environment at ray.init.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
    # address="local": always a fresh cluster of our own, never one a `ray start` left running on this machine
    # Metrics reach the Prometheus endpoint every second (Ray's default: 10 s), so tests can read them.
    # num_cpus=8: logical CPUs, so that the apps of several families (1.5 CPUs each) can be up at once; they share
    # the machine's real cores anyway.
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        logging_level="warning",
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def image_root(tmp_path_factory) -> Path:
    """The app's image_urls.file_root, with one image in it."""
    root = tmp_path_factory.mktemp("images")
    make_image(96, 64, seed=7).save(root / "seven.png")
    return root


@pytest.fixture(scope="session")
def app_args(checkpoint, image_root) -> dict:
    # Image URLs on, any host, but only public addresses, except 127.0.0.1 where tests serve images. The timeout
    # is generous for a loopback fetch on a loaded machine; the test server's /slow outlasts it (image_server.py).
    image_urls = {
        "allow_http": True,
        "allowed_domains": ["*"],
        "allowed_networks": ["127.0.0.1/32"],
        "timeout_s": 5.0,
        "file_root": str(image_root),
    }
    # 64 MiB of KV cache (131,072 tokens of the tiny model), not the default 1 GiB: zeroing that took 1.9 CPU-s of
    # each LLM replica's start.
    llm = {"max_model_len": 1024, "cpu_kv_cache_gib": 0.0625}
    return {"model": str(checkpoint), "limits": LIMITS, "llm": llm, "image_urls": image_urls}


@pytest.fixture(scope="session")
def base_url(ray_serve, app_args) -> str:
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app(app_args), name="vlm", route_prefix="/")
    return ray_serve


# Apps that several modules share, each deployed once at its first test and deleted after its last: the fixture's
# name -> its delete, once deployed. pytest_collection_modifyitems runs the modules of an app one after another.
SHARED_APPS: dict[str, Callable[[], None] | None] = {"tools_app": None, "demo_app": None}


@contextlib.contextmanager
def _shared(fixture: str, ray_serve: str, args: dict, checkpoint: Path, name: str):
    from ray import serve

    from tests.deployments.parity import deployed

    with deployed(ray_serve, args, checkpoint, name) as client:
        SHARED_APPS[fixture] = lambda: serve.delete(name)  # deleted again at exit: a no-op by then
        yield client


@pytest.fixture(scope="session")
def tools_app(ray_serve, app_args, checkpoint, tmp_path_factory):
    """The tiny checkpoint with a chat template that renders tools (tests/tool_template.py), colocated (no encoder
    tier), at /tools: (its client, its checkpoint). The tool calls, docs/clients.md's recipes, colocated mode."""
    from tests.tool_template import with_tools_template

    tools = with_tools_template(checkpoint, tmp_path_factory.mktemp("tools") / "qwen2-vl-tiny")
    args = {**app_args, "encoder": {"colocated": True}}
    with _shared("tools_app", ray_serve, args, tools, "tools") as client:
        yield client, tools


@pytest.fixture(scope="session")
def demo_app(ray_serve, app_args):
    """The shipped, trained demo model (demo/qwen2-vl-shapes) at /demo, as `make serve` runs it (colocated), with an
    API key (so 401 is real); the client sends it. What it sees, the API's schemas, and the playground."""
    args = {**app_args, "auth": {"api_keys": [DEMO_KEY]}, "encoder": {"colocated": True}}
    with _shared("demo_app", ray_serve, args, Path(__file__).parents[1] / "demo" / "qwen2-vl-shapes", "demo") as c:
        c.headers["Authorization"] = f"Bearer {DEMO_KEY}"
        yield c


_LAST_USER: dict[str, str] = {}  # a shared app's fixture -> the node id of its last test


def pytest_collection_finish(session):
    """After every reordering and deselection (-k, -m): the tests that run, in their order."""
    _LAST_USER.update({f: i.nodeid for i in session.items for f in SHARED_APPS if f in getattr(i, "fixturenames", ())})


def pytest_runtest_teardown(item):
    for fixture, delete in SHARED_APPS.items():
        if delete and _LAST_USER.get(fixture) == item.nodeid:
            SHARED_APPS[fixture] = None
            delete()


@pytest.fixture
def client(base_url):
    import httpx

    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


def pytest_collection_modifyitems(items):
    """Mark `cluster` every test that starts Ray: through the `ray_serve` fixture (directly or by a fixture that
    needs it), or as an e2e test, which brings up an app in a cluster of its own (the multi-node and front-door
    tests). `make test-fast` (`-m "not cluster"`) is the rest: the unit tier.

    Then run whole modules in three groups, each in its files' order: the unit modules, the modules whose clusters
    are their own, and last those of the session's cluster (`ray_serve`). That cluster and its app idle at a quarter
    of a core (2 cores here): started for the first test that needs it, it stays up until the end. The modules of
    a shared app (SHARED_APPS) run last, one app's after another, so that each app is up only while they run."""
    group: dict[str, tuple[int, str]] = {}
    for item in items:
        names = getattr(item, "fixturenames", ())
        uses_session = "ray_serve" in names
        if uses_session or item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.cluster)
        module = item.nodeid.split("::")[0]
        shared = min((f for f in SHARED_APPS if f in names), default="")  # its modules are run together
        this = (2, shared) if uses_session else (1 if item.get_closest_marker("e2e") else 0, "")
        group[module] = max(group.get(module, this), this)
    items.sort(key=lambda item: group[item.nodeid.split("::")[0]])  # stable: the files' order within a group
