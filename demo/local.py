"""The app run locally as `make serve` runs it, for the tests and the benchmarks alike: free ports for its servers, the
Makefile's environment and the front door it opens, serve_config.yaml rewritten for a checkpoint and a port, small
limits every test can hit, and the pids of a running app's replicas."""

from __future__ import annotations

import copy
import os
import random
import socket
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
# Small limits for the end-to-end app, so that every limit can be hit cheaply.
LIMITS = {
    "max_request_bytes": 2 << 20,
    "max_image_pixels": 640 * 640,
    "max_images_per_request": 4,
    "default_max_tokens": 16,
}


# Ports handed to servers come from below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768 up):
# a port-0 bind or an outgoing connection (a Ray cluster starting makes hundreds) takes ports from that range, so a
# port found free there can be taken before the server binds it. That was seen in CI as an Ingress replica that
# could not bind the one port a test pinned for it. 20000-29999 also misses Ray's worker ports (10002-19999) and Serve's
# direct-ingress ranges (HTTP 30000-30999, gRPC 40000-40999).
SERVER_PORTS = range(20000, 30000)


def free_port() -> int:
    """A port nothing listens on, from SERVER_PORTS; random, so that test sessions running at once rarely pick the
    same one."""
    for port in random.sample(SERVER_PORTS, 500):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))  # also taken when something listens on 127.0.0.1 only
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {SERVER_PORTS}")


# NOTE: as bench/server.py: Serve's default proxy readiness and health checks (5 s / 10 s) kill the proxy on a
# loaded 2-core machine, and 32 streams load it. They are health checks only, not a serving setting.
OURS_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}


def merge_args(base: dict, extra: dict) -> dict:
    """`extra` over `base`, nested dicts merged key by key (an app's args, a deployment's options)."""
    return {
        **base,
        **{
            k: merge_args(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
            for k, v in extra.items()
        },
    }


def serve_env(ingress: str | None = None) -> dict[str, str]:
    """What `make serve [INGRESS=...]` puts in Ray's environment: the Makefile is the one place that says it."""
    cmd = ["make", "-s", "--no-print-directory", "-C", str(ROOT), "serve-env"]
    cmd += [f"INGRESS={ingress}"] if ingress else []
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return dict(kv.split("=", 1) for kv in out.split())


def ingress_of(env: dict[str, str]) -> str:
    """The front door that Ray 2.60 opens with env (HAProxy turns direct ingress on too)."""
    if env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        return "haproxy"
    return "direct" if env.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1" else "proxy"


def ingress_ports(ingress: str, port: int) -> tuple[int, dict[str, str], list[str]]:
    """(the port clients use, env, why) for a run of `ingress` on one machine whose http_options.port is port.
    Direct and HAProxy: the Ingress replica's own port pinned to one free one (Ray's default: the first free one from
    30000 up, per replica on the node); clients use it under direct, HAProxy's http_options.port under haproxy.
    HAProxy's fixed side ports (stats 8404, metrics 9101, fallback proxy 8500) move to free ones, so that two
    clusters on one machine do not collide."""
    if ingress == "proxy":
        return port, {}, []
    own = free_port()
    env = {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(own), "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(own + 1)}
    why = [f"env {k}={v} (the Ingress replica's port, a free one)" for k, v in env.items()]
    if ingress == "haproxy":
        side = {
            k: str(free_port())
            for k in (
                "RAY_SERVE_HAPROXY_STATS_PORT",
                "RAY_SERVE_HAPROXY_METRICS_PORT",
                "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
            )
        }
        env |= side
        why += [f"env {k}={v} (a free one)" for k, v in side.items()]
    return (own if ingress == "direct" else port), env, why


def ours_config(
    checkpoint: Path, port: int, app_args: dict, deployments: dict[str, dict] | None = None
) -> tuple[dict, list[str]]:
    """serve_config.yaml with the bench checkpoint and a free port, and each change from it, in words; `deployments`:
    options merged into the named deployments' entries, or entries of their own (`{"Encoder": {...}}`)."""
    base = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config = copy.deepcopy(base)
    config["http_options"]["port"] = port
    app = config["applications"][0]
    app["args"] = merge_args({**app["args"], "model": str(checkpoint)}, app_args)
    changes = [
        f"args.model: {checkpoint} (serve_config.yaml: {base['applications'][0]['args']['model']})",
        f"http_options.port: {port} (serve_config.yaml: {base['http_options']['port']}), a free one",
    ]
    changes += [f"args.{k}: {v} (merged from --app-args)" for k, v in app_args.items()]
    for name, options in (deployments or {}).items():
        entries = [d for d in app["deployments"] if d["name"] == name]
        if entries:
            entries[0].update(merge_args(entries[0], options))
        else:  # e.g. the Encoder, which the laptop's file leaves to its decorator (encoder.colocated there)
            app["deployments"].append({"name": name, **options})
        changes.append(f"deployments {name}: {options} ({'merged' if entries else 'added'})")
    if app["args"].get("encoder", {}).get("colocated"):  # no Encoder in the app: Serve refuses settings for one
        app["deployments"] = [d for d in app["deployments"] if d["name"] != "Encoder"]
        changes.append("deployments Encoder: removed (encoder.colocated: the app has no Encoder)")
    changes += [
        f"env {k}={os.environ.get(k, v)} (health checks only; `make serve` leaves Serve's default)"
        for k, v in OURS_ENV.items()
    ]
    changes += [
        f"env {k}={v} (from the caller's environment)"
        for k, v in sorted(os.environ.items())
        if k.startswith(("RAY_SERVE_", "VLM_")) and k not in OURS_ENV
    ]
    return config, changes


def replica_pids(app: str) -> dict[str, int]:
    """{"LLM#<replica id>": pid} for the app's live replicas, and the HTTP proxy."""
    # NOTE: ray.util.state.list_actors asks the dashboard, which the test cluster runs without; the GCS actor
    # table, which that API reads in the end, has the pid too.
    from ray._private.state import actors

    out = {}
    for actor in actors(actor_state_name="ALIVE").values():
        name = actor.get("Name") or ""
        if name.startswith(f"SERVE_REPLICA::{app}#"):
            _, deployment, replica = name.split("#")
            out[f"{deployment}#{replica}"] = actor["Pid"]
        elif actor["ActorClassName"] == "ProxyActor":
            out["proxy"] = actor["Pid"]
    return out


__all__ = [
    "LIMITS",
    "OURS_ENV",
    "SERVER_PORTS",
    "free_port",
    "ingress_of",
    "ingress_ports",
    "merge_args",
    "ours_config",
    "replica_pids",
    "serve_env",
]
