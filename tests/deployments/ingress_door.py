"""Our app behind one of `make serve`'s front doors (INGRESS=direct or haproxy), in a Ray cluster of its own: Ray
reads the door from the environment of every process it starts, so it cannot be switched on in the test session's.

`python -m tests.deployments.ingress_door <http port> <app args as JSON>`, run by
tests/deployments/test_ingress_doors.py with `make serve-env`'s environment. Once the app is up it prints one line
`INGRESS_DOOR {json}`: the classes of Serve's actors and the ports of the controller's target groups (where the Ingress
replicas listen themselves). Then each line on stdin gets one such line back, the LLM's stats. EOF: Serve and Ray
shut down.
"""

from __future__ import annotations

import json
import sys

import ray
from ray import serve
from ray.serve._private.common import RequestProtocol

from deployments.app import build_app

TAG = "INGRESS_DOOR"


def say(obj: dict) -> None:
    print(f"{TAG} {json.dumps(obj)}", flush=True)


def _class_of(actor) -> str:
    """The class an actor was made from (its name says only `SERVE_PROXY_ACTOR-<node>` for HAProxy's manager too)."""
    return actor._ray_actor_creation_function_descriptor.class_name


def main() -> None:
    port, args = int(sys.argv[1]), json.loads(sys.argv[2])
    # Worker logs stay in Ray's log files: this process's stdout is the test's channel.
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(args), name="vlm", route_prefix="/")
    except RuntimeError:  # Serve says only which deployment failed; the why is in its status (to the test's log)
        for name, d in serve.status().applications["vlm"].deployments.items():
            print(f"{name}: {d.status} {d.message}", file=sys.stderr, flush=True)
        raise
    controller = serve.context._get_global_client()._controller
    # from_proxy_manager: what HAProxy is told (the replicas); without it HAProxy mode names HAProxy itself
    groups = ray.get(controller.get_target_groups.remote("vlm", True))
    targets = [t.port for g in groups if g.protocol == RequestProtocol.HTTP for t in g.targets]
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"]
    classes = sorted(_class_of(ray.get_actor(n, namespace="serve")) for n in names)
    say({"targets": targets, "actor_classes": classes})
    llm = serve.get_deployment_handle("LLM", app_name="vlm")
    for _ in sys.stdin:
        say(llm.stats.remote().result())
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
