"""A per-step trace for diagnosis: with VLM_STEP_TRACE=<path> in a replica's environment, the engine appends one
line per step to <path>.<pid>: its start (time.monotonic, s), its duration (ms), its decode rows, its prefill
tokens and the worker's torch threads. Where a served step's time goes (a step against the gaps between steps, a
prefill beside the decodes) is then a matter of reading the file; off (the default) it costs one `is None`."""

from __future__ import annotations

import os
import time

import torch


class StepTrace:
    def __init__(self, path: str) -> None:
        self.file = open(f"{path}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115 (lines: a killed replica loses none)

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get("VLM_STEP_TRACE")
        return cls(path) if path else None

    def record(self, started: float, chunks: list) -> None:
        ms = (time.monotonic() - started) * 1e3
        decode = sum(c.n == 1 for c in chunks)
        prefill = sum(c.n for c in chunks if c.n != 1)
        self.file.write(f"{started:.4f} {ms:.2f} {decode} {prefill} {torch.get_num_threads()}\n")
