"""The start-up check's results, kept per key on this node, so that a second encoder replica of the same checkpoint on
the same kind of device, with the same limits, starts without re-encoding the worst batch and re-measuring its
throughput (issue 53: the check was 3.5-5 s of each scale-up here, more with a real tower).

The key is everything the result depends on: the checkpoint (its path, and each file's size and modification time),
the preprocessing (its largest image), each part's device and dtype, the device's model and memory, the batch limit,
the CPU threads, the torch version, and the model factory when one stands in for the family's encoder. A changed
limit is another key, so it checks again. One JSON file a key in a directory (by default under the node's temporary
directory), written whole and renamed into place, so a reader never sees half a result; replicas starting together
may each check once."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("ray.serve")
DEFAULT_DIR = Path(tempfile.gettempdir()) / "vlm-encoder-checks"


@dataclass(frozen=True, slots=True)
class CheckResult:
    what: str  # the worst batch, as the check logged it
    seconds: float  # its forward
    peak: str  # its memory, as the check logged it
    gflops: float  # the measured throughput (GFLOP/s, encoders/cost.py's estimate)
    checked_at: float  # epoch seconds


def device_identity(device: str) -> str:
    """The device's model and memory, or this CPU's model and core count: a result measured on one holds for another
    of the same kind."""
    dev = torch.device(device)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return f"{props.name} {props.total_memory}"
    model = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines() if line.startswith("model name")), ""
    )
    return f"cpu {model} x{os.cpu_count()}"


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def checkpoint_identity(model_dir: str | Path) -> list[tuple[str, int, int]]:
    """Each file of the checkpoint: (name, size, modification time in ns)."""
    root = Path(model_dir).resolve()
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in root.iterdir() if p.is_file())


def check_key(**facts: Any) -> str:
    """A digest of the facts a result depends on (JSON-able values, repr() of the rest)."""
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=repr).encode()).hexdigest()[:32]


class StartupChecks:
    """The results on this node, one file a key under `directory`."""

    def __init__(self, directory: str | Path = DEFAULT_DIR):
        self.directory = Path(directory)

    def get(self, key: str) -> CheckResult | None:
        try:
            return CheckResult(**json.loads((self.directory / f"{key}.json").read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as e:  # unreadable or from another version: check again
            logger.warning("encoder start-up check: ignoring the stored result %s (%s)", key, e)
            return None

    def put(self, key: str, result: CheckResult) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.")
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(result), f)
            os.replace(tmp, self.directory / f"{key}.json")
        except OSError as e:  # a read-only or full disk costs the next replica a check, nothing else
            logger.warning("encoder start-up check: could not keep the result in %s (%s)", self.directory, e)


__all__ = ["DEFAULT_DIR", "CheckResult", "StartupChecks", "check_key", "checkpoint_identity", "device_identity"]
