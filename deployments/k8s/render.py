"""Keep the KubeRay manifest's serveConfigV2 equal to serve_config.yaml plus the cluster's overrides (below).

`python -m deployments.k8s.render` rewrites the serveConfigV2 block of deployments/k8s/rayservice.yaml in place;
`--check` exits 1 when it is stale (a test runs that check)."""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import yaml

from deployments.encoder.autoscaling import AUTOSCALING, POLICY_PATH

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = Path(__file__).with_name("rayservice.yaml")
BLOCK_START, BLOCK_END = "  serveConfigV2: |\n", "  rayClusterConfig:\n"
INDENT = "    "

# What a GPU cluster changes, and nothing else: every other key is serve_config.yaml's. The Encoder replicas get GPUs
# of their own and their CPU threads from their `num_cpus` (the laptop's file gives its one Encoder both cores:
# `encoder.cpu_threads`), and scale on cost up to a GPU each of the encoder group (the laptop's: one replica). The
# custom resources `encoder_slot` and `llm_slot` are what the worker groups of the manifest offer, so that encoders
# and the LLM land on their own node groups.
HTTP_HOST = "0.0.0.0"
MODEL = "/models/Qwen2-VL-2B-Instruct"  # the checkpoint on the pods' models volume
ACTOR_OPTIONS = {
    "Encoder": {"num_cpus": 2, "num_gpus": 1, "resources": {"encoder_slot": 1}},
    "LLM": {"num_cpus": 4, "num_gpus": 1, "resources": {"llm_slot": 1}},
}
ENCODER_MAX_REPLICAS = 8  # one per GPU of the encoder group at its largest
# Each Encoder replica gets a node of its own (a GPU pod of the encoder group), so starts do not share cores: the
# policy starts as many at once as it asks for, and the Ray autoscaler provisions their pods together.
ENCODER_POLICY = {"policy_function": POLICY_PATH, "policy_kwargs": {"max_starting": ENCODER_MAX_REPLICAS}}


def cluster_config(local: dict) -> dict:
    """serve_config.yaml's dict -> the cluster's: the overrides above applied to a copy."""
    config = copy.deepcopy(local)
    config["http_options"]["host"] = HTTP_HOST
    app = config["applications"][0]
    app["args"]["model"] = MODEL
    app["args"]["encoder"]["colocated"] = False
    app["args"]["encoder"]["cpu_threads"] = None
    for deployment in app["deployments"]:
        if deployment["name"] in ACTOR_OPTIONS:
            deployment["ray_actor_options"] = dict(ACTOR_OPTIONS[deployment["name"]])
        if deployment["name"] == "Encoder":  # the code's policy and delays, named (an entry's replaces them whole)
            deployment["autoscaling_config"] = {
                **copy.deepcopy(AUTOSCALING),
                "max_replicas": ENCODER_MAX_REPLICAS,
                "policy": ENCODER_POLICY,
            }
    return config


def render(manifest: str, local: dict) -> str:
    """The manifest's text with its serveConfigV2 block rewritten from `local`."""
    start = manifest.index(BLOCK_START) + len(BLOCK_START)
    end = manifest.index(BLOCK_END, start)
    body = yaml.safe_dump(cluster_config(local), sort_keys=False, default_flow_style=False, width=110)
    block = "".join(INDENT + line if line.strip() else line for line in body.splitlines(keepends=True))
    return manifest[:start] + block + manifest[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 when the manifest is stale; write nothing")
    args = parser.parse_args(argv)
    local = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    current = MANIFEST.read_text()
    wanted = render(current, local)
    if args.check:
        if wanted != current:
            print(f"{MANIFEST} is stale: run python -m deployments.k8s.render", file=sys.stderr)
            return 1
        return 0
    MANIFEST.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
