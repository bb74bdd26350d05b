"""Phase two of tests/deployments/multinode_cluster.py: the LLM's node dies with requests in flight on it.

The kill is triggered on state, not on a sleep: a stream has had its first token and its next step holds
(tests/deployments/instruments.py's HeldLM, while a file exists), and the LLM engine reports the requests sent after
it, streaming and not, waiting in its queue. Then the node's processes are killed, as a crashed or preempted machine's
would be. Also `recover`: the wait for a replacement node's first 200, which both phases use.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from ray import serve

if TYPE_CHECKING:
    from ray._private.node import Node
    from ray.cluster_utils import Cluster

WAITING = 4  # requests waiting in the engine's queue behind the stream under way, every other one streaming
CAP_S = 60.0  # a wait on state; and a request silent this long is a hang


def text_body(i: int, stream: bool, max_tokens: int = 8) -> dict:
    """A text-only request: its prefill is one step, so the stream's next one-token step is its first decode."""
    return {
        "messages": [{"role": "user", "content": f"Question {i}?"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # the random weights' first token may be EOS: the stream must go on after it
        "stream": stream,
        "return_token_ids": True,
    }


def post(base_url: str, body: dict, first_token: threading.Event | None = None) -> dict[str, Any]:
    """One request, streamed or not, read to its end: status (0: silent for CAP_S, a hang), Retry-After, the OpenAI
    error body's `error` (of the body, or of a stream's error event), a stream's events in order ("token", "error",
    "other", "[DONE]"), its seconds and when it ended. `first_token` is set once a stream's first token has arrived."""
    out: dict[str, Any] = {"status": 0, "retry_after": None, "error": None, "events": []}
    started = time.monotonic()
    try:
        with (
            httpx.Client(base_url=base_url, timeout=CAP_S) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            out["status"], out["retry_after"] = r.status_code, r.headers.get("retry-after")
            if r.status_code != 200 or not body["stream"]:
                out["error"] = json.loads(r.read()).get("error")
            else:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        out["events"].append(_event(line.removeprefix("data: "), out))
                        if out["events"][-1] == "token" and first_token is not None:
                            first_token.set()
    except httpx.TimeoutException:
        out["status"] = 0
    out["ended"] = time.monotonic()
    out["seconds"] = round(out["ended"] - started, 2)
    if out["status"] not in (0, 200):
        print(f"{body['messages'][0]['content']}: {out}", flush=True)
    return out


def _event(data: str, out: dict[str, Any]) -> str:
    if data == "[DONE]":
        return data
    event = json.loads(data)
    if "error" in event:
        out["error"] = event["error"]
        return "error"
    return "token" if any(c.get("token_ids") for c in event.get("choices", ())) else "other"


def llm_retries() -> int:
    """Generations the (one) Ingress replica sent once more after their LLM replica went away."""
    return serve.get_deployment_handle("Ingress", app_name="vlm").stats.remote().result(timeout_s=10)["llm_retries"]


def engine_queue() -> tuple[int, int]:
    """(sequences running, requests waiting) in the LLM replica's engine."""
    stats = serve.get_deployment_handle("LLM", app_name="vlm").stats.remote().result(timeout_s=10)
    return int(stats["running"]), int(stats["waiting"])


def lose_llm_node(cluster: Cluster, node: Node, base_url: str, hold: Path) -> tuple[dict[str, Any], float]:
    """The stream under way and the requests waiting, then the node's loss; then a request while no node can host
    an LLM. Returns (each request's outcome, seconds from the removal to its end, and the generations sent once
    more; the removal's monotonic time)."""
    hold.touch()
    first_token = threading.Event()
    with ThreadPoolExecutor(1 + WAITING) as pool:
        stream = pool.submit(post, base_url, text_body(0, stream=True, max_tokens=16), first_token)
        if not first_token.wait(CAP_S):
            raise RuntimeError(f"the stream had no first token in {CAP_S:g} s: {stream.result()}")
        waiting = [pool.submit(post, base_url, text_body(i, stream=i % 2 == 0)) for i in range(1, 1 + WAITING)]
        deadline = time.monotonic() + CAP_S
        while (queue := engine_queue()) != (1, WAITING):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine has (running, waiting) {queue}, not (1, {WAITING})")
            time.sleep(0.05)
        retries = llm_retries()
        removed = time.monotonic()
        cluster.remove_node(node, allow_graceful=False)
        out = {"stream": stream.result(), "waiting": [f.result() for f in waiting]}
        out["llm_retries"] = llm_retries() - retries
    out["outage"] = post(base_url, text_body(1 + WAITING, stream=False))  # no node can host an LLM now
    hold.unlink()  # the replacement replica's steps go on
    for r in (out["stream"], *out["waiting"], out["outage"]):
        r["s_after_removal"] = round(r.pop("ended") - removed, 2)
    return out, removed


def recover(ask: Callable[[int], int], removed: float, replaced: float, deadline_s: float) -> dict[str, Any]:
    """Requests one after another (`ask(n)` -> status) until a 200 (the replacement node serves), another status,
    or `deadline_s` after the removal: {"recovery_statuses": {status: count}, and the seconds to the first 200}."""
    out: dict[str, Any] = {}
    statuses: list[int] = []
    while time.monotonic() - removed < deadline_s:
        status = ask(len(statuses))
        statuses.append(status)
        if status == 200:
            out["s_removal_to_first_200"] = round(time.monotonic() - removed, 1)
            out["s_replacement_to_first_200"] = round(time.monotonic() - replaced, 1)
            break
        if status != 503:
            break
        # NOTE: no wait for Retry-After: each 503 here has already waited for a replica (encoder.timeout_s, or the
        # ingress's ROUTE_TIMEOUT_S for an LLM replica).
    out["recovery_statuses"] = {str(s): statuses.count(s) for s in sorted(set(statuses))}
    return out


__all__ = ["CAP_S", "WAITING", "engine_queue", "llm_retries", "lose_llm_node", "post", "recover", "text_body"]
