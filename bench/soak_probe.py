"""What the soak samples between rounds: each replica's resident memory and the object store's use."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from demo.local import replica_pids


def rss_bytes(pid: int) -> int | None:
    """VmRSS from /proc (no psutil); None when the process is gone or on another machine."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def object_store() -> dict[str, int]:
    """Bytes and objects in the object store (plasma), all nodes."""
    # NOTE: ray.available_resources()["object_store_memory"] is a capacity that objects do not consume (it stays
    # put while plasma fills) and ray.util.state needs the dashboard; the raylets' store stats, which
    # `ray memory --stats-only` prints, are the bytes actually in use. The GCS address is explicit: another Ray
    # cluster on this machine must not answer instead.
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    stats = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address)).store_stats
    return {"bytes": stats.object_store_bytes_used, "objects": stats.num_local_objects}


def sample(app: str) -> dict[str, Any]:
    from ray import serve

    pids = replica_pids(app)
    rss = {name: rss_bytes(pid) for name, pid in pids.items()}
    name_of = {pid: name for name, pid in pids.items()}
    census = [
        c
        for deployment in ("Ingress", "Encoder", "LLM")
        for c in serve.get_deployment_handle(deployment, app).broadcast("heap").results(timeout_s=60)
    ]
    return {
        "rss": {k: v for k, v in rss.items() if v is not None},
        "objects": {name_of[c["pid"]]: c["python_objects"] for c in census if c["pid"] in name_of},
        "store": object_store(),
        "engine": serve.get_deployment_handle("LLM", app).stats.remote().result(),
        "cache": _cache(serve.get_deployment_handle("Ingress", app).stats.remote().result()),
    }


def _cache(ingress_stats: dict) -> dict[str, int]:
    """The ingress's embedding cache counts (hits, misses, bytes...), zeros when it has none (colocated: the LLM
    replica's own, in its memory)."""
    keys = ("hits", "misses", "evictions", "entries", "objects", "bytes", "max_bytes")
    return {k: ingress_stats.get(f"cache_{k}", 0) for k in keys}


def serve_logs(app: str) -> dict[Path, int]:
    """The app's replica logs, the proxies', and what its replica processes wrote to stderr (asyncio and Python's own
    tracebacks land there), each with its size now (where a later `log_problems` starts)."""
    import ray

    root = Path(ray._private.worker._global_node.get_logs_dir_path())
    pids = replica_pids(app).values()
    files = [
        *(root / "serve").glob(f"replica_{app}_*.log"),
        *(root / "serve").glob("proxy_*.log"),
        *(f for pid in pids for f in root.glob(f"worker-*-{pid}.err")),
    ]
    return {f: f.stat().st_size for f in files}


# Ray Serve's own errors, not ours: counted apart. Its request router sets the result of a request that its caller
# cancelled meanwhile (seen on the Encoder's calls to the EmbeddingCache replica there was, Ray 2.60). Only where no
# frame of the traceback is ours: the same error from our routers' override (deployments/llm/router.py) was
# ours, and fixed.
UPSTREAM = ("Unexpected error in _fulfill_pending_requests",)
OURS = re.compile(r'File "[^"]*/(deployments|encoders|llm|schemas)/')
THROUGH_OURS = " [through our code]"


def upstream(entry: str) -> bool:
    """A logged error that is Ray Serve's own (counted apart), not ours (a violation)."""
    return any(u in entry for u in UPSTREAM) and THROUGH_OURS not in entry


ENTRY = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d{4}-")  # Serve's line format starts an entry


def log_problems(offsets: dict[Path, int], app: str) -> list[str]:
    """Entries at ERROR or above, and any with a traceback, that the app's replicas and the proxies logged since
    `offsets` (a file that appeared since, e.g. a new replica's, is read whole)."""
    out = []
    for f in {**serve_logs(app), **offsets}:
        if not f.exists():
            continue
        with f.open("rb") as fh:
            fh.seek(offsets.get(f, 0))
            out += problems(f.name, fh.read().decode(errors="replace"))
    return out


def problems(name: str, text: str) -> list[str]:
    """The entries of a log's `text` at ERROR or above, or with a traceback: each as the file's name, its first line
    and its last (the exception), for short, marked when a frame of its traceback is ours. Lines that do not start an
    entry (a traceback's) belong to the one before."""
    entries: list[list[str]] = []
    for line in text.splitlines():
        if ENTRY.match(line) or not entries:
            entries.append([line])
        else:
            entries[-1].append(line)
    return [
        f"{name}: {e[0][:200]}"
        + (f" ... {e[-1][:200]}" if len(e) > 1 else "")
        + (THROUGH_OURS if any(OURS.search(x) for x in e[1:]) else "")
        for e in entries
        if e[0].startswith(("ERROR", "CRITICAL")) or any(x.startswith("Traceback") for x in e)
    ]


__all__ = [
    "THROUGH_OURS",
    "UPSTREAM",
    "log_problems",
    "problems",
    "upstream",
    "object_store",
    "rss_bytes",
    "sample",
    "serve_logs",
]
