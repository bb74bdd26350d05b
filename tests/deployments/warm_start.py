"""A scale-up of the Encoder from one replica to two on a Ray cluster of its own, for
tests/deployments/test_warm_start.py: `python -m tests.deployments.warm_start CHECKPOINT warm|cold` prints a line
"RESULT <json>": each replica's start phases (deployments/replica.py) and the seconds from the scale-up to the second
replica's first image. `warm`: the cluster's workers preload the Encoder's module (deployments/ray_private.py)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(checkpoint: str, mode: str) -> None:
    if mode == "warm":  # NOTE: before ray.init: the raylet and its workers inherit it
        os.environ.update({"RAY_preload_python_modules": "deployments.encoder.server", "PYTHONPATH": str(ROOT)})
    import ray
    from ray import serve

    from deployments.encoder.server import Encoder
    from tests.helpers import image_bytes, make_image

    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning")
    serve.start(logging_config={"log_level": "WARNING"})
    args = {"model": checkpoint, "encoder": {"cache_gib": 0}}

    def app(n: int):
        options = {"num_replicas": n, "autoscaling_config": None, "ray_actor_options": {"num_cpus": 0.25}}
        return Encoder.options(**options).bind(args)

    handle = serve.run(app(1), name="warm", route_prefix=None)
    image = image_bytes(make_image(64, 64))
    handle.encode.remote([image], cost=0.1).result()
    time.sleep(8.0)  # the first replica keeps a spare worker (every 5 s), which then waits, warm, in Ray's pool
    scaled = time.time()
    threading.Thread(target=lambda: serve.run(app(2), name="warm", route_prefix=None), daemon=True).start()
    starts: dict[float, dict] = {}
    while time.time() - scaled < 120 and len(starts) < 2:
        for _ in range(4):
            handle.encode.remote([image], cost=0.1).result()
            stats = handle.stats.remote().result()
            if "first_image" in stats["start"]:
                starts[stats["serving_since"]] = stats["start"]
        time.sleep(0.1)
    newest = max(starts)
    print("RESULT", json.dumps({"starts": list(starts.values()), "second_after_s": newest - scaled}), flush=True)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
