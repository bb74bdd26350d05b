"""A Ray cluster of nodes on one machine, each pinned to CPUs of its own (`taskset -c N ray start ...`), as machines
of their own would be: what `make bench-tier` compares the layouts on. The README's cluster recipe, with what one
machine changes (free ports, one temp dir) and token authentication off (nothing but this process connects); every
node advertises `node<i>: 1` (for placing a deployment on it) and `lm: 1` (one LLM replica a node)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.proc_cpu import ray_roots
from demo.local import free_port

ROOT = Path(__file__).resolve().parents[1]


class PinnedNodes:
    """`cpus[i]`: the CPU list of node i (`taskset -c`'s syntax), the head first. `env`: what every Ray process of
    the cluster reads (direct ingress, worker niceness: `make serve`'s environment). A context manager: the nodes
    stop, and the temp dir goes, at its end."""

    def __init__(self, cpus: list[str], env: dict[str, str], logical_cpus: int = 4):
        self.cpus, self.logical_cpus = cpus, logical_cpus
        # NOTE: Ray's unix sockets live under the temp dir, whose path must stay short (107 bytes).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="vlm-tier-", dir="/tmp"))
        self.gcs_port = free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"
        bin_dir = Path(sys.executable).parent
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH_"))}
        self.env |= env | {
            "PATH": f"{bin_dir}{os.pathsep}{self.env.get('PATH', '')}",
            "PYTHONPATH": str(ROOT),
            "RAY_AUTH_MODE": "disabled",
            # tests/conftest.py's proxy check timeouts: a loaded 2-core machine misses Serve's defaults.
            "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
            "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
        }
        self.groups: list[int] = []

    def __enter__(self) -> PinnedNodes:
        try:
            for i, cpus in enumerate(self.cpus):
                self._start(i, cpus)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self, i: int, cpus: str) -> None:
        resources = json.dumps({f"node{i}": 1, "lm": 1})
        argv = ["taskset", "-c", cpus, "ray", "start", f"--resources={resources}"]
        argv += [f"--num-cpus={self.logical_cpus}", f"--temp-dir={self.temp_dir}", "--disable-usage-stats"]
        argv += [f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}"]
        if i == 0:
            argv += ["--head", f"--port={self.gcs_port}", "--include-dashboard=false"]
            argv += [f"--ray-client-server-port={free_port()}"]
        else:
            argv += [f"--address={self.address}"]
        log = self.temp_dir / f"ray-start-{i}.log"
        with log.open("w") as out:  # a session of its own: its pid is the process group of the node's processes
            proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=out, stderr=out, start_new_session=True)
        self.groups.append(proc.pid)
        if proc.wait(timeout=180) != 0:
            raise RuntimeError(f"ray start of node {i} failed:\n{log.read_text()[-3000:]}")

    def connect(self) -> None:
        """This process as the cluster's driver."""
        import ray

        ray.init(address=self.address, logging_level="warning", log_to_driver=False)

    def processes(self) -> list[int]:
        """The cluster's processes that `ray start` left behind (found by the temp dir on their command lines)."""
        return ray_roots(str(self.temp_dir))

    def stop(self) -> None:
        """`ray stop`, for these nodes only (their process groups): SIGTERM, then SIGKILL."""
        try:
            import ray

            ray.shutdown()
        except Exception:
            pass
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for pgid in self.groups[::-1]:
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and self.processes():
                time.sleep(0.5)
        self.groups = []
        shutil.rmtree(self.temp_dir, ignore_errors=True)


__all__ = ["PinnedNodes"]
