"""Multi-node: encoder and LLM on different nodes of a real Ray cluster; the encoder's node dies, Serve recovers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def wide_checkpoint(checkpoint, tmp_path) -> Path:
    """The tiny checkpoint with a larger pixel budget, so that one image's embeddings outgrow Ray's inline limit and
    go through the object store, as a real model's do (Qwen2-VL-2B: about 1 MB per image)."""
    out = shutil.copytree(checkpoint, tmp_path / checkpoint.name)
    config = json.loads((out / "preprocessor_config.json").read_text())
    config["size"]["longest_edge"] = 28 * 28 * 512
    (out / "preprocessor_config.json").write_text(json.dumps(config))
    return out


def _run_cluster_script(checkpoint: Path, timeout_s: float = 240) -> tuple[dict | None, str]:
    """tests/deployments/multinode_cluster.py in its own process: a `Cluster` needs its own Ray, and this session
    may already be connected to one (the `ray_serve` fixture). Returns (its summary or None, its output)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # The proxy check timeouts of tests/conftest.py: a loaded 2-core machine misses Serve's defaults.
    env |= {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.deployments.multinode_cluster", str(checkpoint)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()  # Ray's nodes drain and stop their processes on SIGTERM
        out, _ = proc.communicate(timeout=60)
        out += f"\n[timed out after {timeout_s} s]"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [line for line in out.splitlines() if line.startswith("MULTINODE_SUMMARY ")]
    if proc.returncode != 0 or not lines:
        return None, out
    return json.loads(lines[-1].split(" ", 1)[1]), out


@pytest.mark.timeout(300)
def test_encoder_node_loss_gives_503s_then_recovers_on_a_new_node(wide_checkpoint):
    s, out = _run_cluster_script(wide_checkpoint)
    assert s is not None, f"multinode_cluster failed; its output ends with:\n{out[-8000:]}"
    nodes, context = s["nodes"], json.dumps(s, indent=1)
    print({k: v for k, v in s.items() if k.startswith("s_")})  # timings, shown with -rP

    # Placement by custom resources: ingress and cache on the head, encoder and LLM each on a node of their own.
    assert s["placement"] == {
        "Ingress": [nodes["head"]],
        "EmbeddingCache": [nodes["head"]],
        "Encoder": [nodes["encoder"]],
        "LLM": [nodes["llm"]],
    }, context
    # Every answer needed embeddings made on the encoder's node, too large to travel inline: the object store.
    assert s["embedding_bytes"] > s["inline_limit_bytes"], context
    assert s["before"]["statuses"] == [200] * 4, context

    # The encoder's node is killed while it encodes the images of 4 requests: they, and a request that comes while
    # no node can host an encoder, end in a 503 with Retry-After within seconds; never a 500, never a hang.
    for phase in (s["in_flight"], s["outage"]):
        assert set(phase["statuses"]) == {503} and all(phase["retry_after"]), context
        assert max(phase["seconds"]) < 30, context

    # A replacement node joins; Serve reschedules the encoder there and requests succeed again.
    assert set(s["recovery_statuses"]) <= {"200", "503"} and s["recovery_statuses"].get("200") == 1, context
    assert s["placement_after"] == {**s["placement"], "Encoder": [nodes["replacement"]]}, context
    assert s["after"]["statuses"] == [200] * 4, context
    # Same weights on a new node, same embeddings: greedy answers are those from before the loss.
    assert s["after"]["token_ids"] == s["before"]["token_ids"], context
