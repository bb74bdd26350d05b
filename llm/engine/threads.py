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
from pathlib import Path

import torch

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


__all__ = ["set_thread_intra_op_threads"]
