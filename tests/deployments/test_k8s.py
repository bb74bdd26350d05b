"""The KubeRay manifest serves what serve_config.yaml serves: its serveConfigV2 is that file with the cluster's
overrides and nothing else (the encoders on replicas of their own), it validates, the worker groups offer what the
replicas ask for, and every pod runs the one image (named once) of the pinned Ray with Ray's token auth on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from deployments.encoder.autoscaling import AUTOSCALING
from deployments.k8s import render
from schemas import AppArgs

ROOT = Path(__file__).resolve().parents[2]


def _differences(a, b, path=()) -> set[tuple]:
    """Paths (keys, list indices) where two parsed YAML documents differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {p for k in a.keys() | b.keys() for p in _differences(a.get(k), b.get(k), path + (k,))}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return {p for i, (x, y) in enumerate(zip(a, b)) for p in _differences(x, y, path + (i,))}
    return set() if a == b else {path}


def test_the_manifest_is_serve_config_with_the_cluster_overrides_only():
    assert render.main(["--check"]) == 0, "run: python -m deployments.k8s.render"
    local = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    manifest = yaml.safe_load(render.MANIFEST.read_text())
    served = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    app = served["applications"][0]
    encoder = next(d for d in app["deployments"] if d["name"] == "Encoder")
    assert encoder == {
        "name": "Encoder",
        "ray_actor_options": render.ACTOR_OPTIONS["Encoder"],
        # the code's, named; every replica asked for started at once (a node each: no cores shared)
        "autoscaling_config": {
            **AUTOSCALING,
            "max_replicas": render.ENCODER_MAX_REPLICAS,
            "policy": render.ENCODER_POLICY,
        },
    }
    assert encoder["autoscaling_config"]["upscale_delay_s"] < 30  # tuned for reaction time, not Ray's defaults
    names = [d["name"] for d in local["applications"][0]["deployments"]]
    enc, llm = (("applications", 0, "deployments", names.index(name)) for name in ("Encoder", "LLM"))
    local["applications"][0]["deployments"][enc[-1]].pop("autoscaling_config")  # the laptop's one replica
    encoder.pop("autoscaling_config")  # replaced whole, as asserted above
    assert _differences(local, served) == {
        ("http_options", "host"), ("applications", 0, "args", "model"),
        ("applications", 0, "args", "encoder", "cpu_threads"),  # the GPU replicas' num_cpus, not the laptop's 2
        (*enc, "ray_actor_options", "num_cpus"), (*enc, "ray_actor_options", "num_gpus"),
        (*enc, "ray_actor_options", "resources"),
        (*llm, "ray_actor_options", "num_cpus"), (*llm, "ray_actor_options", "num_gpus"),
        (*llm, "ray_actor_options", "resources"),
    }  # fmt: skip
    args = AppArgs.model_validate({**app["args"], "model": str(ROOT / local["applications"][0]["args"]["model"])})
    assert not args.encoder.colocated  # encoders on the GPU group of their own


def test_gpu_worker_groups_offer_what_the_replicas_ask_for():
    manifest = yaml.safe_load(render.MANIFEST.read_text())
    served = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    groups = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    offered = {}
    for group in groups:
        container = group["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1", group["groupName"]
        offered[group["groupName"]] = json.loads(json.loads(group["rayStartParams"]["resources"]))
    for deployment in served["applications"][0]["deployments"]:
        options = deployment.get("ray_actor_options", {})
        for resource, amount in options.get("resources", {}).items():
            hosts = [name for name, res in offered.items() if res.get(resource, 0) >= amount]
            assert hosts and options["num_gpus"] == 1, (deployment["name"], resource)
    encoder = next(d for d in served["applications"][0]["deployments"] if d["name"] == "Encoder")
    group = next(g for g in groups if g["groupName"] == "encoders")
    assert group["maxReplicas"] >= encoder["autoscaling_config"]["max_replicas"]  # a pod per encoder at the top


def test_every_pod_runs_the_one_image_of_the_pinned_ray_with_token_auth():
    text = render.MANIFEST.read_text()
    cluster = yaml.safe_load(text)["spec"]["rayClusterConfig"]
    # KubeRay's own switch (a Secret, RAY_AUTH_MODE and RAY_AUTH_TOKEN in every Ray container); it needs Ray >= 2.52.
    assert cluster["authOptions"] == {"mode": "token"}
    ray = re.search(r"^ray\[serve\]==(\S+)", (ROOT / "requirements.txt").read_text(), re.M)[1]
    assert cluster["rayVersion"] == ray  # the image's Ray (tests/test_dockerfile.py pins its base to it)
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    containers = [c for g in groups for c in g["template"]["spec"]["containers"]]
    assert len({c["image"] for c in containers}) == 1, [c["image"] for c in containers]
    # One value to edit: the anchor; every other `image:` is its alias.
    assert len(re.findall(r"^\s*image: &image \S+", text, re.M)) == 1
    assert len(re.findall(r"^\s*image: \*image\s*$", text, re.M)) == len(containers) - 1
    for c in containers:  # nothing turns it off behind authOptions' back
        assert not [e for e in c.get("env", []) if e["name"].startswith("RAY_AUTH")], c["name"]
