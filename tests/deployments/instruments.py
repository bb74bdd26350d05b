"""Test instruments: an encoder whose outputs record who deserializes them, a decoder that fails on cue, and a
reader of one app's per-replica metrics."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from encoders import Qwen2VLVisionEncoder
from llm import Qwen2LM


def _where() -> str:
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return f"{ctx.app_name}:{ctx.deployment}"
    except Exception:
        return f"pid{os.getpid()}"


def _record_and_unwrap(record_dir: str, tensor: torch.Tensor) -> torch.Tensor:
    with open(Path(record_dir) / f"{os.getpid()}.log", "a") as f:
        f.write(_where() + "\n")
    return tensor


class Traced:
    """Pickles as 'record where I am, then be the plain tensor': whoever deserializes it leaves a mark."""

    def __init__(self, tensor: torch.Tensor, record_dir: str):
        self.tensor, self.record_dir = tensor, record_dir

    def cpu(self) -> Traced:
        return self

    def __reduce__(self):
        return (_record_and_unwrap, (self.record_dir, self.tensor))


class TracingEncoder:
    def __init__(self, model_dir, device="cpu", dtype=torch.float32, *, record_dir: str):
        self.inner, self.record_dir = Qwen2VLVisionEncoder(model_dir, device, dtype), record_dir
        self.hidden_size = self.inner.hidden_size

    def preprocess(self, image, size=None):
        return self.inner.preprocess(image, size)

    def forward(self, batch):
        return [Traced(t, self.record_dir) for t in self.inner.forward(batch)]

    def encode(self, images):
        return self.forward([self.preprocess(im) for im in images])


class SlowEncoder:
    """Each batched forward takes at least `delay_s` and leaves (pid, time, images) in `record_dir`: which replica
    served, and when."""

    def __init__(self, model_dir, device="cpu", dtype=torch.float32, *, delay_s: float, record_dir: str):
        self.inner, self.delay_s, self.record_dir = Qwen2VLVisionEncoder(model_dir, device, dtype), delay_s, record_dir
        self.hidden_size = self.inner.hidden_size

    def preprocess(self, image, size=None):
        return self.inner.preprocess(image, size)

    def forward(self, batch):
        time.sleep(self.delay_s)
        with open(Path(self.record_dir) / f"{os.getpid()}.log", "a") as f:
            f.write(f"{os.getpid()} {time.time():.3f} {len(batch)}\n")
        return self.inner.forward(batch)

    def encode(self, images):
        return self.forward([self.preprocess(im) for im in images])


def per_replica(port: int, app: str, name: str, deployment: str = "LLM") -> dict[str, float]:
    """One Prometheus series of one deployment of `app`, summed by replica (Ray's metrics endpoint at `port`)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels.get("application") == app and s.labels.get("deployment") == deployment:
                out[s.labels["replica"]] = out.get(s.labels["replica"], 0.0) + s.value
    return out


def forwards(record_dir: str | Path) -> list[tuple[int, float, int]]:
    """(pid, unix time, images) of every forward a SlowEncoder ran, in time order."""
    rows = [line.split() for f in Path(record_dir).glob("*.log") for line in f.read_text().splitlines()]
    return sorted(((int(p), float(t), int(n)) for p, t, n in rows), key=lambda r: r[1])


def deserializations(record_dir: str | Path) -> list[str]:
    return [line for f in sorted(Path(record_dir).glob("*.log")) for line in f.read_text().split()]


class _InstrumentedLM(Qwen2LM):
    @classmethod
    def load(cls, model_dir, device="cpu", dtype=torch.float32) -> Qwen2LM:
        """The real loader, then this class's forward (a `model_factory` for the LLM deployment)."""
        model = Qwen2LM.from_pretrained(model_dir, device=device, dtype=dtype)
        model.__class__ = cls
        return model


class FaultyLM(_InstrumentedLM):
    """Fails when decoding reaches cache position 40 (mid-stream), or on prefill of 100+ tokens (before any token)."""

    fail_at, fail_prefill_from = 40, 100

    def forward(self, inputs_embeds, positions, cache, meta):
        decode_at = positions.shape[1] == 1 and int(positions[0, 0]) == self.fail_at
        if decode_at or positions.shape[1] >= self.fail_prefill_from:
            raise RuntimeError("injected fault")
        return super().forward(inputs_embeds, positions, cache, meta)


class SlowLM(_InstrumentedLM):
    """Every engine step takes at least `delay_s` more: streams that last long enough to leave or time out."""

    delay_s = 0.05

    def forward(self, inputs_embeds, positions, cache, meta):
        time.sleep(self.delay_s)
        return super().forward(inputs_embeds, positions, cache, meta)
