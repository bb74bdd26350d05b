"""CPU intra-op threads for one thread of the process: the engine's worker gets the cores, every other thread one.

NOTE: torch's CPU kernels run on OpenMP (GNU libgomp in the Linux wheels), and libgomp keeps a thread team for
every thread that ever runs a parallel region. Once the teams hold more threads than there are CPUs, libgomp
stops spinning between parallel regions (GOMP_SPINCOUNT's documented "more OpenMP threads than available CPUs"
case: 100 spins), so each of the thousands of small ops in a decode step waits for a futex wake-up. The engine's
worker ran about twice as slowly at batch 1 when the replica's loading thread also had a team
(`make bench-kernels` measures it). So the replica sets one thread process-wide
(`torch.set_num_threads(1)`: no other thread forms a team) and the worker alone takes N, through the per-thread
setters of OpenMP (`omp_set_num_threads`) and MKL (`mkl_set_num_threads_local`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llm.engine.engine import EngineConfig

logger = logging.getLogger(__name__)


def _loaded_library(prefix: str) -> ctypes.CDLL | None:
    """The already-loaded shared library whose file name starts with `prefix` (torch's own copy, not the system's)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if Path(path).name.startswith(prefix):
            return ctypes.CDLL(path)
    return None


def set_thread_intra_op_threads(n: int) -> int:
    """Run the calling thread's torch ops on n threads, without touching other threads; returns what torch reports.

    Falls back to the process-wide `torch.set_num_threads(n)` where torch does not use GNU OpenMP.
    """
    torch.get_num_threads()  # ATen's lazy per-thread initialization first: it would overwrite what follows
    gomp = _loaded_library("libgomp")
    if gomp is None:
        logger.info("no libgomp in this process: torch.set_num_threads(%d) for the whole process", n)
        torch.set_num_threads(n)
        return torch.get_num_threads()
    gomp.omp_set_num_threads(n)
    torch_cpu = _loaded_library("libtorch_cpu")
    if torch_cpu is not None and hasattr(torch_cpu, "mkl_set_num_threads_local_"):  # float32 GEMMs go to MKL
        torch_cpu.mkl_set_num_threads_local_(ctypes.byref(ctypes.c_int(n)))  # the Fortran name: by reference
    return torch.get_num_threads()


def _cpu_jiffies(cpus: set[int], stat: str) -> tuple[int, int]:
    """(busy, total) jiffies of `cpus` since boot, from /proc/stat's per-CPU lines."""
    busy = total = 0
    for line in stat.splitlines():
        name, *fields = line.split() or [""]
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(values)
        busy += sum(values) - values[3] - values[4]
    return busy, total


def _own_jiffies(stat: str) -> int:
    """This process's user + system jiffies, from /proc/self/stat (fields after the parenthesised name)."""
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))


class CoresFollowLoad:
    """How many threads the engine's worker should run on now: the cores that the node's other processes leave it.

    Every `interval_s` it reads how busy its CPUs were since the last look (/proc/stat), less what this process used
    (/proc/self/stat): that is the demand of the encoders, the ingress and everything else on the node, in cores.
    NOTE: OpenMP threads wait for each other at the end of every op, so one that the kernel preempts stalls the
    whole step: on 2 cores under heavy load, 2 engine threads ran a served benchmark into 60 s timeouts. So the
    worker takes one more core only when the others left it nearly idle (free >= threads + 1 - up_margin), and gives
    cores back as soon as the others want them (free < threads - down_margin).
    """

    def __init__(
        self,
        floor: int,
        ceiling: int,
        *,
        interval_s: float = 0.2,
        up_margin: float = 0.2,
        down_margin: float = 0.5,
        cpus: set[int] | None = None,
        read_stat: Callable[[], str] | None = None,
        read_self: Callable[[], str] | None = None,
        now: float | None = None,
    ):
        self.cpus = cpus if cpus is not None else set(os.sched_getaffinity(0))
        self.floor, self.ceiling = floor, max(floor, min(ceiling, len(self.cpus)))
        self.interval_s, self.up_margin, self.down_margin = interval_s, up_margin, down_margin
        self._read_stat = read_stat or (lambda: Path("/proc/stat").read_text())
        self._read_self = read_self or (lambda: Path("/proc/self/stat").read_text())
        self.threads = floor
        self.others = 0.0  # the other processes' demand at the last look, in cores
        self._new_window(now)

    def _new_window(self, now: float | None) -> None:
        """The next look measures the load from now on, once `interval_s` has passed."""
        self._last = self._sample()
        self._next = (time.monotonic() if now is None else now) + self.interval_s

    def _sample(self) -> tuple[int, int, int]:
        busy, total = _cpu_jiffies(self.cpus, self._read_stat())
        return busy, total, _own_jiffies(self._read_self())

    def images_arrived(self, now: float | None = None) -> None:
        """The encoder work that the last look saw was for this engine, and it is done: the cores it held are free.
        Take them now (up to the ceiling) and start a new window, whose look puts the count right if others want
        them after all. (Without this, the first prefill step after the images ran on the floor, for what the
        encoder had used before.)"""
        self._new_window(now)
        self.threads = self.ceiling

    def update(self, now: float | None = None) -> int:
        """The worker's thread count for the next step (looks at the load at most once per `interval_s`)."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return self.threads
        self._next = now + self.interval_s
        sample = self._sample()
        busy, total, own = (a - b for a, b in zip(sample, self._last))
        self._last = sample
        if total <= 0:
            return self.threads
        self.others = max(0.0, (busy - own) / total * len(self.cpus))
        free = len(self.cpus) - self.others  # cores the others left
        n = self.threads
        if n < self.ceiling and free >= n + 1 - self.up_margin:
            n += 1
        elif n > self.floor and free < n - self.down_margin:
            n = max(self.floor, int(free + self.down_margin))
        self.threads = n
        return n


def worker_threads(floor: int | None, ceiling: int | None) -> CoresFollowLoad | None:
    """The calling worker's threads at start: `floor` (None: as they are), and what follows the load between `floor`
    and `ceiling` (None where they are the same, or the node's load cannot be read)."""
    if floor is None:
        return None
    threads, cores = set_thread_intra_op_threads(floor), None
    if (ceiling or floor) > floor:
        try:
            cores = CoresFollowLoad(floor, ceiling)
        except OSError as e:  # no /proc (not Linux): stay at the floor
            logger.warning("engine worker: cannot read the node's load (%s), %d threads throughout", e, floor)
    more = f", up to {cores.ceiling} while the node's other processes leave cores idle" if cores else ""
    logger.info("engine worker: %d torch threads%s", threads, more)
    return cores


class StepThreads:
    """The engine worker's threads, step by step, where they follow the load (`llm.cpu_threads_max`): a step of
    `min_rows` rows or more (a prefill chunk, whose GEMMs take milliseconds each) takes what the node's load leaves
    (`cores`); a smaller one (a decode step: a hundred short ops, each waiting for any team thread the ingress
    preempted) keeps the floor, and so does every step while an encoder works for one of the engine's sequences: it
    looks idle between its batches, and taking its core then delays the very images the prefill waits for. Those
    steps also keep to `min_rows` rows, so that the step after the last image arrives is not a long one on the floor;
    and that step takes the cores the encoder held (`CoresFollowLoad.images_arrived`), which the last look still
    counted as busy."""

    def __init__(self, cores: CoresFollowLoad, min_rows: int, counts: dict[str, int]):
        self.cores, self.min_rows, self.counts = cores, min_rows, counts  # counts: the engine's stats, updated here
        self.awaited = False  # the last step awaited an image

    @classmethod
    def start(cls, config: EngineConfig, counts: dict[str, int]) -> StepThreads | None:
        """Sets the calling worker's threads (config.cpu_threads); None where they do not follow the load."""
        cores = worker_threads(config.cpu_threads, config.cpu_threads_max)
        return cls(cores, config.cpu_threads_max_rows, counts) if cores is not None else None

    def budget(self, awaits_images: bool) -> int | None:
        """The next step's most rows (None: the scheduler's own budget)."""
        return self.min_rows if awaits_images and self.min_rows else None

    def before_step(self, rows: int, awaits_images: bool) -> None:
        if self.awaited and not awaits_images:  # the last of the images the engine awaited is here
            self.cores.images_arrived()
        self.awaited = awaits_images
        n = self.cores.update()  # every step, so that the load is always known
        if rows < self.min_rows or awaits_images:
            n = self.cores.floor
        if n != self.counts["cpu_threads"]:
            set_thread_intra_op_threads(n)
            self.counts["cpu_threads"] = n
            self.counts["cpu_thread_changes"] += 1


__all__ = ["CoresFollowLoad", "StepThreads", "set_thread_intra_op_threads", "worker_threads"]
