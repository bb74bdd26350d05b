"""A per-step trace for diagnosis: with VLM_STEP_TRACE=<path> in a replica's environment, the engine appends one
line per step to <path>.<pid>: its start (time.monotonic, s), its duration (ms), its decode rows, its prefill
tokens, the worker's torch threads, and the helper thread's counts so far (offered calls, tasks it computed, tasks
taken over from it: cpu_kernels.helper_stats). Where a served step's time goes (a step against the gaps between
steps, a prefill beside the decodes, the helper's share) is then a matter of reading the file; off (the default)
it costs one `is None` a step."""

from __future__ import annotations

import os
import time

import torch

from llm.model import cpu_kernels


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
        helper = " ".join(map(str, cpu_kernels.helper_stats())) if cpu_kernels.available() else "- - -"
        self.file.write(f"{started:.4f} {ms:.2f} {decode} {prefill} {torch.get_num_threads()} {helper}\n")
