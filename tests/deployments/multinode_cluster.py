"""A real multi-node Ray cluster on this machine: encoder and LLM on different nodes; the encoder's node dies and a
replacement joins, then the LLM's node does the same (tests/deployments/multinode_llm.py).

Run by tests/deployments/test_multinode.py in its own process (a `Cluster` needs its own Ray, and the test session
may already be connected to one): `python -m tests.deployments.multinode_cluster <checkpoint dir>`. Prints one line,
`MULTINODE_SUMMARY {json}`, that the test asserts on.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import ray
import torch
from ray import serve
from ray.cluster_utils import Cluster

from demo.inputs import data_url, make_image
from demo.local import free_port
from deployments.encoder.autoscaling import CostPolicy
from deployments.encoder.server import Encoder
from deployments.ingress import Ingress
from deployments.llm.server import LLM
from encoders import Qwen2VLVisionEncoder, family_of
from schemas import AppArgs
from tests.deployments.instruments import HeldLM
from tests.deployments.multinode_llm import lose_llm_node, recover

# Placement: each node advertises a custom resource; each deployment asks for a sliver of its node's.
HEAD = {"num_cpus": 0.1, "resources": {"head": 0.01}}
ENCODER = {"num_cpus": 0.5, "resources": {"encoder_node": 0.01}}
LLM_OPTIONS = {"num_cpus": 1, "resources": {"llm_node": 0.01}}
# NOTE: a killed node is declared dead after health_check_period_ms * failure_threshold (Ray's default 3 s * 5);
# shortened so the test is quick, not further: on a loaded 2-core machine a live raylet can miss a 1 s check.
SYSTEM_CONFIG = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 2000,
    "health_check_failure_threshold": 3,
}
# Ray's max_direct_call_object_size: a task's return larger than this goes to the object store of the node that made
# it (here: the encoder's), and the LLM's node pulls it from there. Smaller ones travel inline through the caller.
INLINE_LIMIT_BYTES = 100 * 1024
IMAGE_SIZE = 616  # 22 x 22 = 484 image tokens: over the inline limit with the tiny model's 64-wide embeddings
SLOW_SIZE, SLOW_S = 588, 3.0  # images of this size take this much longer to encode
REQUEST_TIMEOUT_S = 60.0
# A cap on the wait for a replacement's first 200, not a claim: an LLM replica's start (a new node's raylet, a worker
# importing torch, the engine's start-up step) took 47 to 77 s of it on a loaded 2-core machine.
RECOVERY_DEADLINE_S = 180.0
IN_FLIGHT = 4


class SlowOnCue(Qwen2VLVisionEncoder):
    """The real encoder, but a batch holding a SLOW_SIZE image takes SLOW_S longer: requests with such images are
    surely inside the encoder when its node is killed."""

    def __init__(self, model_dir: str, **kwargs):
        super().__init__(model_dir, **kwargs)
        self.cue = tuple(family_of(model_dir).processing.from_pretrained(model_dir).grid_thw(SLOW_SIZE, SLOW_SIZE))

    def forward(self, batch: list[tuple[torch.Tensor, tuple[int, int, int]]]) -> list[torch.Tensor]:
        if any(tuple(int(n) for n in grid) == self.cue for _, grid in batch):
            time.sleep(SLOW_S)
        return super().forward(batch)


def build(args: dict[str, Any], hold: Path) -> serve.Application:
    """deployments/app.py's graph, with the per-deployment overrides a multi-node serve_config.yaml would set. The
    LLM's decode steps hold while the file `hold` exists (phase two)."""
    plain = AppArgs.model_validate(args).model_dump()
    # One encoder replica, so that "the encoder's node" is one node.
    encoder = Encoder.options(num_replicas=1, autoscaling_config=None, ray_actor_options=ENCODER).bind(
        plain, model_factory=SlowOnCue
    )
    llm = LLM.options(ray_actor_options=LLM_OPTIONS).bind(plain, model_factory=HeldLM.holding(str(hold)))
    return Ingress.options(ray_actor_options=HEAD).bind(encoder, llm, plain)


def embedding_bytes(checkpoint: str) -> int:
    """Size of one test image's embeddings (float32): what crosses from the encoder's node to the LLM's."""
    tokens = family_of(checkpoint).processing.from_pretrained(checkpoint).num_image_tokens(IMAGE_SIZE, IMAGE_SIZE)
    hidden = json.loads((Path(checkpoint) / "config.json").read_text())["text_config"]["hidden_size"]
    return tokens * hidden * 4


def replica_nodes() -> dict[str, list[str]]:
    """Deployment name -> node ids of its live replica actors (from the GCS actor table)."""
    out: dict[str, list[str]] = {}
    for info in ray._private.state.actors().values():
        name = info["ActorClassName"]
        if info["State"] == "ALIVE" and name.startswith("ServeReplica:vlm:"):
            out.setdefault(name.rsplit(":", 1)[1], []).append(info["Address"]["NodeID"])
    return out


def body(seed: int, size: int = IMAGE_SIZE) -> dict:
    image = {"type": "image_url", "image_url": {"url": data_url(make_image(size, size, seed=seed))}}
    return {
        "messages": [{"role": "user", "content": [image, {"type": "text", "text": f"Picture {seed}?"}]}],
        "max_tokens": 4,
        "temperature": 0,
        "return_token_ids": True,
    }


def ask(client: httpx.Client, seed: int, size: int = IMAGE_SIZE) -> tuple[int, list[int] | None, float, str | None]:
    """(status, token ids or None, seconds, Retry-After). A request that times out is status 0: a hang."""
    started = time.monotonic()
    try:
        r = client.post("/v1/chat/completions", json=body(seed, size))
    except httpx.TimeoutException:
        return 0, None, time.monotonic() - started, None
    elapsed = time.monotonic() - started
    if r.status_code != 200:
        print(f"request {seed}: {r.status_code} {r.text[:300]}", flush=True)
        return r.status_code, None, elapsed, r.headers.get("retry-after")
    return 200, r.json()["choices"][0]["token_ids"], elapsed, None


def ask_once(base_url: str, seed: int, size: int) -> tuple[int, list[int] | None, float, str | None]:
    with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client:
        return ask(client, seed, size)


def _phase(results: list[tuple[int, list[int] | None, float, str | None]]) -> dict:
    return {
        "statuses": [r[0] for r in results],
        "token_ids": [r[1] for r in results],
        "seconds": [round(r[2], 2) for r in results],
        "retry_after": [r[3] for r in results],
    }


def main(checkpoint: str, hold: Path) -> dict:
    summary: dict[str, Any] = {"embedding_bytes": embedding_bytes(checkpoint), "inline_limit_bytes": INLINE_LIMIT_BYTES}
    t0 = time.monotonic()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"head": 1},
            "include_dashboard": False,
            "_system_config": SYSTEM_CONFIG,
        },
    )
    try:
        encoder_node = cluster.add_node(num_cpus=1, resources={"encoder_node": 1}, wait=False)
        llm_node = cluster.add_node(num_cpus=1, resources={"llm_node": 1}, wait=False)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="warning")  # connects to the head node's raylet
        port = free_port()
        # NOTE: HeadOnly: every node of this cluster shares 127.0.0.1, so one proxy per node would clash on the port.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        # Cache off: every request encodes, so every answer needs embeddings from the encoder's node.
        args = {"model": checkpoint, "encoder": {"cache_gib": 0, "timeout_s": 5}, "llm": {"max_model_len": 1024}}
        serve.run(build(args, hold), name="vlm", route_prefix="/")
        summary["s_cluster_and_app_up"] = round(time.monotonic() - t0, 1)
        summary["nodes"] = {"head": cluster.head_node.node_id, "encoder": encoder_node.node_id, "llm": llm_node.node_id}
        summary["placement"] = replica_nodes()
        summary["policy_starts"] = CostPolicy().starts()  # the Encoder policy's starts at once: one per node

        base_url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client:
            summary["before"] = _phase([ask(client, seed) for seed in range(4)])

            # The encoder's node dies (its processes killed, no drain), as a crashed or preempted machine would,
            # while it encodes the images of requests in flight.
            with ThreadPoolExecutor(IN_FLIGHT) as pool:
                burst = [pool.submit(ask_once, base_url, seed, SLOW_SIZE) for seed in range(IN_FLIGHT)]
                time.sleep(SLOW_S / 3)
                removed = time.monotonic()
                cluster.remove_node(encoder_node, allow_graceful=False)
                summary["in_flight"] = _phase([f.result() for f in burst])
            summary["outage"] = _phase([ask(client, 0)])  # a new request, and no node can host an encoder now

            # A replacement node joins (as a cluster autoscaler would start one); Serve reschedules the encoder there.
            replaced = time.monotonic()
            summary["nodes"]["replacement"] = cluster.add_node(num_cpus=1, resources={"encoder_node": 1}).node_id
            summary |= recover(lambda n: ask(client, n % 4)[0], removed, replaced, RECOVERY_DEADLINE_S)
            summary["after"] = _phase([ask(client, seed) for seed in range(4)])
            summary["placement_after"] = replica_nodes()
            summary["s_encoder_phase_done"] = round(time.monotonic() - t0, 1)

            # Phase two: the LLM's node dies with a stream under way and requests waiting in its engine's queue;
            # then a replacement node joins and Serve reschedules the LLM there.
            summary["llm"], removed = lose_llm_node(cluster, llm_node, base_url, hold)
            replaced = time.monotonic()
            summary["nodes"]["llm_replacement"] = cluster.add_node(num_cpus=1, resources={"llm_node": 1}).node_id
            summary["llm"] |= recover(lambda n: ask(client, n % 4)[0], removed, replaced, RECOVERY_DEADLINE_S)
            summary["llm"]["after"] = _phase([ask(client, seed) for seed in range(4)])
            summary["llm"]["placement_after"] = replica_nodes()
        summary["s_requests_done"] = round(time.monotonic() - t0, 1)
    finally:
        # NOTE: no serve.shutdown(): it drains each deployment in turn (about 5 s here) only for the cluster's
        # shutdown to kill every process of every node, Serve's included.
        ray.shutdown()
        cluster.shutdown()
    summary["s_total"] = round(time.monotonic() - t0, 1)
    return summary


if __name__ == "__main__":
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
    # Replicas import `deployments` from this checkout, whatever directory their workers start in.
    root = str(Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="multinode-") as tmp:
        print("MULTINODE_SUMMARY " + json.dumps(main(sys.argv[1], Path(tmp) / "hold")), flush=True)
