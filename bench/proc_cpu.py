"""CPU time of a Ray cluster's processes, by role, from /proc: what each process of the app costs per image.

A process belongs to the cluster when it descends from one of `roots` (the `serve run` or `ray start` processes'
survivors: gcs_server, raylet, the dashboard) and is not the caller itself. Ray names its workers after what they
run (`ray::ServeReplica:<app>:<Deployment>`), which gives the role."""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    ppid: int
    cpu_s: float  # user + system, since the process started
    role: str
    cpus: str = ""  # the CPUs it may run on (`Cpus_allowed_list`): a pinned node's


def _read(pid: int) -> Proc | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # gone meanwhile
        return None
    fields = stat.rsplit(")", 1)[1].split()
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    cpus = next(
        (line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list")), ""
    )
    return Proc(pid, int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK, role_of(cmd, comm), cpus)


def role_of(cmdline: str, comm: str = "") -> str:
    """Ingress, Encoder, LLM...: a Serve replica's deployment; proxy, controller, raylet, gcs,
    the driver (`serve run`), or `other` (Ray's dashboard, log monitor, idle workers)."""
    if m := re.search(r"ServeReplica:[^:\s]+:(\w+)", cmdline):
        return m.group(1)
    for pattern, role in (
        ("ProxyActor", "proxy"),
        ("ServeController", "controller"),
        ("raylet", "raylet"),
        ("gcs_server", "gcs"),
        ("serve run", "driver"),
        ("ray::", "worker"),
    ):
        if pattern in cmdline or pattern in comm:
            return role
    return "other"


def snapshot(roots: list[int]) -> dict[int, Proc]:
    """Every live process descending from `roots` (they included), by pid."""
    procs = {p.pid: p for pid in _pids() if (p := _read(pid)) is not None}
    children: dict[int, list[int]] = defaultdict(list)
    for p in procs.values():
        children[p.ppid].append(p.pid)
    out, todo = {}, [r for r in roots if r in procs]
    while todo:
        pid = todo.pop()
        if pid not in out and pid != os.getpid():
            out[pid] = procs[pid]
            todo += children[pid]
    return out


def ray_roots(marker: str) -> list[int]:
    """The processes whose command line holds `marker` (e.g. a cluster's --temp-dir or session name): `ray start`
    leaves its daemons re-parented to init, so a cluster it started is found by what they were started with."""
    out = []
    for pid in _pids():
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            pass
    return out


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def cpu_by_role(before: dict[int, Proc], after: dict[int, Proc], by_cpus: bool = False) -> dict[str, float]:
    """CPU seconds per role between two snapshots (`by_cpus`: per role and the CPUs it is pinned to, "LLM@0"); a
    process that started in between counts from zero, one that ended in between is lost (its time went with it:
    Ray's workers live as long as the app)."""
    out: dict[str, float] = defaultdict(float)
    for pid, p in after.items():
        start = before[pid].cpu_s if pid in before and before[pid].role == p.role else 0.0
        out[f"{p.role}@{p.cpus}" if by_cpus else p.role] += p.cpu_s - start
    return dict(out)


__all__ = ["Proc", "cpu_by_role", "ray_roots", "role_of", "snapshot"]
