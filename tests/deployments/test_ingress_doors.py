"""`make serve`'s front doors other than Serve's proxy (INGRESS=direct, INGRESS=haproxy; README "Front door"): the
app in a Ray cluster of its own with `make serve-env`'s environment (tests/deployments/ingress_door.py), asked over
HTTP through that door. The answers must equal the proxy's (the session's app: same checkpoint and args, but with its
encoder tier), and a client that leaves mid-stream must still free its sequence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from demo.inputs import data_url, make_image
from demo.local import OURS_ENV, free_port, ingress_of, ingress_ports, serve_env
from tests.helpers import leave_mid_stream

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
TAG = "INGRESS_DOOR "
# NOTE: 900 tokens take the tiny model 1.5 s, and twice (2026-11-29, one run with HAProxy, one direct while a second
# suite ran beside it) the client's leaving reached the ingress only after all of them: ~7 s of generation instead.
LEAVE_TOKENS = 4000


class Door:
    """The child's app: its URL (through the door), what it said at start, and the LLM's stats on request."""

    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log
        self.facts = self._read()

    def _read(self) -> dict:
        while line := self.proc.stdout.readline():
            if line.startswith(TAG):
                return json.loads(line[len(TAG) :])
        raise AssertionError(f"ingress_door exited with {self.proc.wait()}; its log ends:\n{self._tail()}")

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def stats(self) -> dict:
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return self._read()


@pytest.fixture(scope="module", params=["direct", "haproxy"])
def door(request, app_args, tmp_path_factory):
    env = serve_env(request.param)
    assert ingress_of(env) == request.param  # the Makefile's INGRESS=<param> is that door
    port = free_port()
    client_port, port_env, _ = ingress_ports(request.param, port)
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **OURS_ENV, **env, **port_env}
    log = tmp_path_factory.mktemp("door") / f"{request.param}.log"
    with open(log, "w") as err:
        # Colocated: two replicas to start instead of three (the doors are the subject, not the tier). A context of
        # 4096 (the tiny model's own) for LEAVE_TOKENS.
        args = {**app_args, "encoder": {"colocated": True}, "llm": {**app_args["llm"], "max_model_len": 4096}}
        cmd = [sys.executable, "-m", "tests.deployments.ingress_door", str(port), json.dumps(args)]
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
        )
    try:
        d = Door(proc, f"http://127.0.0.1:{client_port}", log)
        d.replica_port = int(port_env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"])
        yield d
    finally:
        proc.stdin.close()  # Serve and Ray shut down on EOF
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait(30)


def _chat(client: httpx.Client, body: dict) -> str:
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return r.json()["choices"][0]["message"]["content"]
    chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    assert r.text.rstrip().endswith("data: [DONE]") and chunks[-1]["choices"][0]["finish_reason"] == "length"
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)


def test_the_ingress_listens_itself_and_answers_as_the_proxy_does(door, client):
    # The controller's targets are the Ingress replica's own port: nothing listens there without direct ingress.
    assert door.facts["targets"] == [door.replica_port], door.facts
    classes = door.facts["actor_classes"]
    if door.url.endswith(f":{door.replica_port}"):  # direct: the client talks to the replica itself
        assert classes.count("ProxyActor") == 1 and "HAProxyManager" not in classes, classes  # the head's, unused
    else:  # HAProxy on the HTTP port instead of Serve's proxy, which stays as the head's fallback
        assert classes.count("HAProxyManager") == 1 and classes.count("ProxyActor") == 1, classes
    image = {"type": "image_url", "image_url": {"url": data_url(make_image(96, 64, seed=3))}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "What is in the picture?"}]}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    expected = _chat(client, body)  # through Serve's proxy, in the session's cluster
    with httpx.Client(base_url=door.url, timeout=60) as c:
        for path in ("/-/healthz", "/-/routes", "/health", "/v1/models"):
            assert c.get(path).status_code == 200, path
        assert _chat(c, {**body, "stream": True}) == expected
        assert _chat(c, body) == expected


def test_a_client_leaving_mid_stream_frees_its_sequence(door):
    before = door.stats()
    with httpx.Client(base_url=door.url, timeout=60) as c:
        leave_mid_stream(c, max_tokens=LEAVE_TOKENS)  # the client goes away after a few chunks
    deadline = time.monotonic() + 60  # a generous cap: it is freed at the next engine step
    while (stats := door.stats())["cancelled"] == before["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stats["cancelled"] == before["cancelled"] + 1 and stats["running"] == 0, stats
    assert stats["finished"] == before["finished"]  # it did not run to its LEAVE_TOKENS
