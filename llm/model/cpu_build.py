"""How the engine's CPU kernels (cpu_kernels.py) are built: torch's cpp_extension, with ninja, the machine's C++
compiler and -march=native, once per kind of CPU and version of the sources, cached under TORCH_EXTENSIONS_DIR."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(n) for n in ("cpu_kernels.cpp", "cpu_attention.cpp", "cpu_linear.cpp")]
_HEADERS = [Path(__file__).with_name(n) for n in ("cpu_simd.h", "cpu_share.h", "cpu_gemm.h")]
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno"]


def _cpu_key() -> str:
    """A short hash of this CPU's instruction-set flags: a build with -march=native is cached per kind of CPU, so a
    cache shared between machines (a home directory on NFS, an image) never hands one CPU another's build."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def build_name(torch_includes: list[str]) -> str:
    """The build's name (its directory under TORCH_EXTENSIONS_DIR): this CPU's kind, then a hash of the sources and of
    everything else the build command names (the sources' paths, torch's headers, the flags), so checkouts of other
    versions (a baseline in `make bench-kernels`, a second work tree) and one venv reached by two paths (a symlink)
    keep one build each instead of rebuilding over each other."""
    paths = [str(f) for f in _SOURCES] + torch_includes + FLAGS
    text = b"".join(f.read_bytes() for f in _SOURCES + _HEADERS) + "\0".join(paths).encode()
    return f"vlm_cpu_kernels_{_cpu_key()}_{hashlib.sha256(text).hexdigest()[:8]}"


@contextlib.contextmanager
def _builder_lock(name: str):
    """Hold an flock on the build directory while building, and remove a `lock` file that no one holds.

    NOTE: torch's cpp_extension marks a build in progress with a plain `lock` file and waits, forever, while one
    exists; a process killed mid-build (a replica restarted, a test run interrupted) leaves it behind, and every later
    replica start hangs. An flock dies with its process: whoever holds it is the only builder alive, so a `lock` file
    it finds is stale."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, verbose=False))
    with open(build_dir / "builder.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield


@contextlib.contextmanager
def _pinned_ninja():
    """The build runs the ninja requirements.txt pins (the `ninja` package's binary), not whichever `ninja` comes first
    on PATH. NOTE: the pinned 1.13 and a distribution's 1.11 do not agree on a command's hash in `.ninja_log`: a
    process with the venv's bin on PATH (a `ray start` from it) and one without (`.venv/bin/python`, and the replicas
    it starts) each took the other's build for a changed command and rebuilt all of it (~100 s on 2 cores)."""
    try:
        import ninja

        bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):  # not installed: torch looks on PATH
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = bin_dir + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


def build():
    """Build (or load the cached build of) the kernels' module; raises where it cannot (no compiler, no ninja)."""
    from torch.utils.cpp_extension import include_paths, load

    name = build_name(include_paths())
    with _builder_lock(name), _pinned_ninja():
        return load(name, sources=[str(f) for f in _SOURCES], extra_cflags=FLAGS, verbose=False)
