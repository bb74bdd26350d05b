"""Test instruments: an encoder whose outputs record who deserializes them, a slow encoder that records its work, an
LLM deployment that records where its embeddings live, decoders that fail, crawl, hold or record on cue, and a reader
of one app's per-replica metrics."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from collections import Counter
from pathlib import Path

import httpx
import ray
import torch
from prometheus_client.parser import text_string_to_metric_families

from deployments.llm.server import LLM
from encoders import family_of
from llm import Qwen2LM


def _where() -> str:
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return f"{ctx.app_name}:{ctx.deployment}"
    except Exception:
        return f"pid{os.getpid()}"


def _actor_name() -> str:
    return ray.get_runtime_context().get_actor_name() or f"pid{os.getpid()}"


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
    def __init__(self, model_dir, device="cpu", dtype=torch.float32, *, record_dir: str, config=None):
        self.inner = family_of(model_dir).encoder(model_dir, device, dtype, config=config)  # Qwen3-VL's: levels too
        self.record_dir = record_dir
        self.hidden_size = self.inner.hidden_size

    def preprocess(self, image, size=None):
        return self.inner.preprocess(image, size)

    def forward(self, batch):
        return [Traced(t, self.record_dir) for t in self.inner.forward(batch)]

    def encode(self, images):
        return self.forward([self.preprocess(im) for im in images])


class SlowEncoder:
    """The checkpoint's family's encoder, each batched forward of which takes at least `delay_s`. In `record_dir` it
    leaves the state a test waits on: each image preprocessed (about to join the batch queue), each forward started
    (with the replica's actor name), and each forward finished, as (pid, time, images): which replica served, and
    when."""

    def __init__(self, model_dir, device="cpu", dtype=torch.float32, *, delay_s: float, record_dir: str, config=None):
        self.inner = family_of(model_dir).encoder(model_dir, device, dtype, config=config)
        self.delay_s, self.record_dir = delay_s, record_dir
        self.hidden_size = self.inner.hidden_size
        self.actor = _actor_name()

    def _record(self, suffix: str, line: str) -> None:
        with open(Path(self.record_dir) / f"{os.getpid()}.{suffix}", "a") as f:
            f.write(line + "\n")

    def preprocess(self, image, size=None):
        out = self.inner.preprocess(image, size)
        self._record("preprocessed", f"{os.getpid()}")
        return out

    def forward(self, batch):
        self._record("started", f"{self.actor} {len(batch)} {time.time():.3f}")
        time.sleep(self.delay_s)
        self._record("log", f"{os.getpid()} {time.time():.3f} {len(batch)}")
        return self.inner.forward(batch)

    def encode(self, images):
        return self.forward([self.preprocess(im) for im in images])


def per_replica(port: int, app: str, name: str, deployment: str = "LLM", **labels: str) -> dict[str, float]:
    """One Prometheus series of one deployment of `app`, summed by replica (Ray's metrics endpoint at `port`), over
    the samples that carry `labels`."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    want = {"application": app, "deployment": deployment, **labels}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in want.items()):
                out[s.labels["replica"]] = out.get(s.labels["replica"], 0.0) + s.value
    return out


def forwards(record_dir: str | Path) -> list[tuple[int, float, int]]:
    """(pid, unix time, images) of every forward a SlowEncoder ran, in time order."""
    rows = [line.split() for f in Path(record_dir).glob("*.log") for line in f.read_text().splitlines()]
    return sorted(((int(p), float(t), int(n)) for p, t, n in rows), key=lambda r: r[1])


def _lines(record_dir: str | Path, suffix: str) -> list[str]:
    return [line for f in sorted(Path(record_dir).glob(f"*.{suffix}")) for line in f.read_text().splitlines()]


def forwards_started(record_dir: str | Path) -> dict[str, int]:
    """Forwards a SlowEncoder began, by replica actor name (a forward in flight: started, not yet in `forwards`)."""
    return Counter(line.split()[0] for line in _lines(record_dir, "started"))


def in_flight_for(record_dir: str | Path) -> dict[str, float]:
    """Seconds each replica's forward in flight has run, by replica actor name (replicas with none left out)."""
    started, finished = forwards_started(record_dir), forwards_finished(record_dir)
    last = {line.split()[0]: float(line.split()[2]) for line in _lines(record_dir, "started")}  # files in time order
    return {n: time.time() - last[n] for n, k in started.items() if k > finished.get(n, 0)}


def forwards_finished(record_dir: str | Path) -> dict[str, int]:
    """Forwards a SlowEncoder finished, by replica actor name."""
    return Counter(_name_of_pid(record_dir)[pid] for pid, _, _ in forwards(record_dir))


def _name_of_pid(record_dir: str | Path) -> dict[int, str]:
    return {
        int(f.stem): line.split()[0]
        for f in Path(record_dir).glob("*.started")
        for line in f.read_text().splitlines()[:1]
    }


def images_preprocessed(record_dir: str | Path) -> int:
    """Images a SlowEncoder preprocessed: each one then waits in its replica's batch queue."""
    return len(_lines(record_dir, "preprocessed"))


def deserializations(record_dir: str | Path) -> list[str]:
    return [line for f in sorted(Path(record_dir).glob("*.log")) for line in f.read_text().split()]


def inline_limit() -> int:
    """Bytes up to which Ray returns a task's result inline (in the reply, through the caller) rather than through
    the object store: the cluster's system config where set, else Ray's default (`max_direct_call_object_size`,
    100 KiB in ray_config_def.h; Ray 2.60 does not expose the effective value to Python)."""
    config = ray._private.state.state.get_system_config()
    return int(config.get("max_direct_call_object_size", os.environ.get("RAY_max_direct_call_object_size", "102400")))


class LocatingLLM(LLM.func_or_class):
    """The LLM deployment, which first records where each embedding it was sent lives: its size, and the nodes whose
    object store holds it (none: it came inline). It waits for them without reading them."""

    def __init__(self, args, model_factory=None, *, record_dir: str):
        super().__init__(args, model_factory)
        self.record_dir = record_dir

    def _locate(self, refs: list) -> None:
        ray.wait(refs, num_returns=len(refs), timeout=60, fetch_local=False)
        # NOTE: the owner learns where an object was stored from the raylet, asynchronously: a ref that is ready may
        # not have a location yet. Wait on that state (an object sent inline never gets one: the cap ends the wait).
        deadline = time.monotonic() + 10
        while True:
            where = ray.experimental.get_object_locations(refs, timeout_ms=60_000).values()
            if all(w["node_ids"] for w in where) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        with open(Path(self.record_dir) / f"{os.getpid()}.located", "a") as f:
            f.writelines(json.dumps({"size": w["object_size"], "nodes": len(w["node_ids"])}) + "\n" for w in where)

    async def generate(self, request, media=None):
        if media:
            await asyncio.to_thread(self._locate, media)
        async for item in super().generate(request, media):
            yield item


def locations(record_dir: str | Path) -> list[dict]:
    """(size, nodes) of every embedding a LocatingLLM was sent."""
    return [json.loads(line) for line in _lines(record_dir, "located")]


class _InstrumentedLM(Qwen2LM):
    @classmethod
    def load(cls, model_dir, device="cpu", dtype=torch.float32) -> Qwen2LM:
        """The real loader, then this class's forward (a `model_factory` for the LLM deployment)."""
        model = Qwen2LM.from_pretrained(model_dir, device=device, dtype=dtype)
        model.__class__ = cls
        return model

    @classmethod
    def with_attrs(cls, **attrs):
        """A `model_factory` whose model has `attrs` set (what it records into, what it waits on)."""
        return functools.partial(cls._load_with, attrs=attrs)

    @classmethod
    def _load_with(cls, model_dir, device="cpu", dtype=torch.float32, *, attrs: dict) -> Qwen2LM:
        model = cls.load(model_dir, device, dtype)
        for name, value in attrs.items():
            setattr(model, name, value)
        return model


class FaultyLM(_InstrumentedLM):
    """Fails when decoding reaches cache position 40 (mid-stream), or on prefill of 100+ tokens (before any token);
    not in the replica's start-up step (its first forward, ModelRunner.check_peak_step), which must pass to serve."""

    fail_at, fail_prefill_from = 40, 100
    started = False

    def forward(self, inputs_embeds, positions, cache, meta, deepstack=None):
        if not self.started:
            self.started = True
            return super().forward(inputs_embeds, positions, cache, meta, deepstack)
        decode_at = positions.shape[1] == 1 and int(positions[0, 0]) == self.fail_at
        if decode_at or positions.shape[1] >= self.fail_prefill_from:
            raise RuntimeError("injected fault")
        return super().forward(inputs_embeds, positions, cache, meta, deepstack)


class SlowLM(_InstrumentedLM):
    """Every engine step takes at least `delay_s` more: streams that last long enough to leave or time out."""

    delay_s = 0.05

    def forward(self, inputs_embeds, positions, cache, meta, deepstack=None):
        time.sleep(self.delay_s)
        return super().forward(inputs_embeds, positions, cache, meta, deepstack)


class HeldLM(_InstrumentedLM):
    """While the file `hold` exists, a one-token step (a lone stream's decode, after its first token went out) does
    not end: the stream stays under way and requests that come meanwhile wait in the engine's queue."""

    hold: str

    @classmethod
    def holding(cls, hold: str):
        """A `model_factory` whose model holds on the file `hold`."""
        return cls.with_attrs(hold=hold)

    def forward(self, inputs_embeds, positions, cache, meta, deepstack=None):
        while positions.shape[1] == 1 and os.path.exists(self.hold):
            time.sleep(0.05)
        return super().forward(inputs_embeds, positions, cache, meta, deepstack)


class RecordingLM(_InstrumentedLM):
    """Records each forward, the start-up step's too, as (unix time, tokens) in `record_dir` (see `llm_forwards`):
    when the engine prefilled what."""

    record_dir: str

    @classmethod
    def recording(cls, record_dir: str):
        """A `model_factory` whose model records into `record_dir`."""
        return cls.with_attrs(record_dir=record_dir)

    def forward(self, inputs_embeds, positions, cache, meta, deepstack=None):
        with open(Path(self.record_dir) / f"{os.getpid()}.lm", "a") as f:
            f.write(f"{time.time():.3f} {inputs_embeds.shape[0]}\n")
        return super().forward(inputs_embeds, positions, cache, meta, deepstack)


def llm_forwards(record_dir: str | Path) -> list[tuple[float, int]]:
    """(unix time, tokens) of every forward a RecordingLM ran, in time order."""
    rows = [line.split() for line in _lines(record_dir, "lm")]
    return sorted((float(t), int(n)) for t, n in rows)
