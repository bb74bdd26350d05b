"""The README's cluster recipe, run as written on this machine: its `bash cluster` block line by line (a head node, an
encoder node, `serve deploy` with Ray's token auth, `serve shutdown`, `ray stop`) and its `yaml cluster` deployments.

What one machine changes, and nothing else: HEAD is 127.0.0.1; every port Ray would fix (6379, 8265, 10001, 52365)
is a free one, and each node gets a temp dir and logical CPUs of its own; the token file is the test's; the config is
serve_config.yaml with a tiny checkpoint, a free HTTP port, one proxy (two would share 127.0.0.1) and num_gpus 0.
`ray stop` stops every Ray process on a machine, other test sessions' too: here it stops the process groups of the
`ray start`s this test ran (each runs in a session of its own, and every process of its node inherits that group).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from demo.inputs import data_url, make_image
from demo.local import free_port, ours_config

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
RAY_STOP_GRACE_S = 16.0  # `ray stop --grace-period`'s default
DEPLOY_TIMEOUT_S = 300.0  # a cap: the app's start (torch, weights, the encoder's start-up check) on 2 loaded cores


def readme_block(lang: str) -> str:
    """The body of the README's one fenced block tagged `lang cluster`."""
    found = re.findall(rf"^```{lang} cluster\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    assert len(found) == 1, f"README.md needs one ```{lang} cluster block, has {len(found)}"
    return found[0]


def commands() -> list[str]:
    """The bash block's commands, `a && b` split in two (comments stay: bash drops them)."""
    return [part.strip() for line in readme_block("bash").splitlines() for part in line.split(" && ") if part.strip()]


def live_members(pgid: int) -> list[int]:
    """Pids of the group's processes that still run (zombies left to init hold nothing)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after `pid (comm)`: state, ppid, pgrp, ...
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def stop_groups(pgids: list[int], grace_s: float = RAY_STOP_GRACE_S) -> list[int]:
    """`ray stop`, for these groups only: SIGTERM, then SIGKILL for what outlives the grace period (as `ray stop` does;
    a raylet or the GCS often does). Returns the pids still running after both."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        for pgid in pgids:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(live_members(g) for g in pgids):
            time.sleep(0.5)
    return [pid for pgid in pgids for pid in live_members(pgid)]


class OneMachine:
    """Runs the recipe's commands with the one-machine changes of the module docstring."""

    def __init__(self, workdir: Path, checkpoint: Path):
        self.workdir, self.checkpoint = workdir, checkpoint
        self.ports = {"gcs": free_port(), "dashboard": free_port(), "http": free_port()}
        self.dashboard = f"http://127.0.0.1:{self.ports['dashboard']}"
        self.groups: list[int] = []  # one per `ray start`, in start order
        # NOTE: Ray's unix sockets live under the temp dir: a pytest tmp path can pass their 107-byte limit.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="vlm-ray-", dir="/tmp"))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH_"))}
        self.env |= {
            "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{self.env.get('PATH', '')}",
            # tests/conftest.py's proxy check timeouts: a loaded 2-core machine misses Serve's defaults.
            "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
            "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
        }

    def local(self, command: str) -> str:
        gcs = re.search(r"--port=(\d+)", readme_block("bash"))[1]  # the head's port, as the README gives it
        for old, new in (
            (f"HEAD:{gcs}", f"127.0.0.1:{self.ports['gcs']}"),
            (f"--port={gcs}", f"--port={self.ports['gcs']}"),
            ("HEAD:8265", f"127.0.0.1:{self.ports['dashboard']}"),  # Ray's dashboard port
        ):
            command = command.replace(old, new)
        return command

    def run(self, command: str, on_deployed) -> None:
        argv = shlex.split(command, comments=True)
        if argv[:1] == ["export"]:
            # The shell evaluates the assignments (`~`, `$PWD`); the token file is the test's own.
            out = subprocess.run(
                ["bash", "-c", f"{command}\nenv -0"], cwd=ROOT, env=self.env, capture_output=True, check=True
            ).stdout
            self.env = dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)
            assert "RAY_AUTH_TOKEN_PATH" in self.env, "the recipe names the token file (here: the test's own)"
            self.env["RAY_AUTH_TOKEN_PATH"] = str(self.workdir / "ray-token")
        elif argv[:2] == ["ray", "start"]:
            self.ray_start(self.local(command))
        elif argv[:2] == ["ray", "stop"]:
            left = stop_groups(self.groups[::-1])  # the encoder node first, as an operator would
            self.groups = []
            assert not left, f"still running after SIGKILL: {left}"
        elif argv[:2] == ["serve", "deploy"]:
            config = self.workdir / "serve_config.yaml"
            config.write_text(yaml.safe_dump(self.config(), sort_keys=False))
            self.check(self.local(command).replace("serve_config.yaml", str(config), 1))
            on_deployed(self)
        else:
            self.check(self.local(command))

    def ray_start(self, command: str) -> None:
        flags = [f"--temp-dir={self.temp_dir}", "--num-cpus=2", "--disable-usage-stats"]
        flags.append(f"--dashboard-agent-listen-port={free_port()}")
        if "--head" in command:
            flags += [f"--dashboard-port={self.ports['dashboard']}", f"--ray-client-server-port={free_port()}"]
        log = (self.workdir / f"ray-start-{len(self.groups)}.log").open("w")
        # A session of its own: its pid becomes the process group of every process of this node.
        argv = shlex.split(command, comments=True) + flags
        proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=log, stderr=log, start_new_session=True)
        self.groups.append(proc.pid)
        assert proc.wait(timeout=180) == 0, (self.workdir / log.name).read_text()[-4000:]

    def check(self, command: str) -> None:
        done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=self.env, capture_output=True, text=True)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"

    def config(self) -> dict:
        """serve_config.yaml as bench/peer_servers.py rewrites it, with the README's args and deployments (its
        entries replace those of the same name, or are added)."""
        changes = yaml.safe_load(readme_block("yaml"))
        args = {**changes["args"], "llm": {"max_model_len": 1024}}
        entries = {change["name"]: change for change in changes["deployments"]}
        config, _ = ours_config(self.checkpoint, self.ports["http"], args, entries)
        config["proxy_location"] = "HeadOnly"
        for entry in config["applications"][0]["deployments"]:
            if entry["name"] in entries:
                entry["ray_actor_options"]["num_gpus"] = 0
        return config

    def token(self) -> str:
        return Path(self.env["RAY_AUTH_TOKEN_PATH"]).read_text().strip()


def wait_running(cluster: OneMachine, headers: dict) -> dict:
    deadline, status = time.monotonic() + DEPLOY_TIMEOUT_S, None
    while time.monotonic() < deadline:
        r = httpx.get(f"{cluster.dashboard}/api/serve/applications/", headers=headers, timeout=30)
        app = r.json()["applications"].get("vlm", {}) if r.status_code == 200 else {}
        status = app.get("status")
        if status == "RUNNING":
            return app
        assert status not in ("DEPLOY_FAILED", "UNHEALTHY"), app.get("message")
        time.sleep(1)
    raise AssertionError(f"app not RUNNING after {DEPLOY_TIMEOUT_S} s: {status}")


def serves_and_places(cluster: OneMachine) -> None:
    """After `serve deploy`: the control plane wants the token, the app answers, replicas sit where the recipe says."""
    assert httpx.get(f"{cluster.dashboard}/api/serve/applications/", timeout=30).status_code == 401
    headers = {"Authorization": f"Bearer {cluster.token()}"}
    app = wait_running(cluster, headers)
    image = {"type": "image_url", "image_url": {"url": data_url(make_image(96, 64, seed=3))}}
    body = {"messages": [{"role": "user", "content": [image, {"type": "text", "text": "What?"}]}], "max_tokens": 4}
    r = httpx.post(f"http://127.0.0.1:{cluster.ports['http']}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None, r.text
    nodes = httpx.get(f"{cluster.dashboard}/api/v0/nodes", headers=headers, timeout=30).json()
    resources = {n["node_id"]: n["resources_total"] for n in nodes["data"]["result"]["result"]}
    for change in yaml.safe_load(readme_block("yaml"))["deployments"]:
        (wanted,) = change["ray_actor_options"]["resources"]  # the custom resource of its kind of node
        replicas = app["deployments"][change["name"]]["replicas"]
        assert replicas and all(wanted in resources[r["node_id"]] for r in replicas), (change, replicas, resources)


@pytest.mark.timeout(900)
def test_the_readme_cluster_recipe_serves_with_token_auth(checkpoint, tmp_path):
    cluster = OneMachine(tmp_path, checkpoint)
    ran_deploy = []
    try:
        for command in commands():
            cluster.run(command, on_deployed=lambda c: (serves_and_places(c), ran_deploy.append(True)))
        assert ran_deploy and cluster.groups == [], "the recipe deploys, and ends with `ray stop`"
    finally:
        stop_groups(cluster.groups[::-1], grace_s=5)
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)
