"""`make bench-encoder`, the parts around the encoder: an embedding's trip through Ray, and base64 decoding."""

from __future__ import annotations

import base64
import os
import statistics
import time
from collections.abc import Callable

import pybase64
import torch

MIB = 1 << 20


def elapsed_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `repeats` runs, after `warmup` unmeasured ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(elapsed_ms(fn) for _ in range(repeats))


def _actors():
    import ray

    @ray.remote(num_cpus=0)
    class Producer:
        """Stands in for an Encoder replica: its method returns the embedding, and the caller owns it."""

        def __init__(self, ours: bool):
            self.stamps: dict[int, float] = {}
            if ours:
                from deployments.transfer import send_tensors_out_of_band

                send_tensors_out_of_band()

        def make(self, call: int, tokens: int, hidden: int, dtype: str) -> torch.Tensor:
            x = torch.randn(tokens, hidden).to(getattr(torch, dtype))  # (num_image_tokens, llm_hidden)
            time.sleep(0.1)  # NOTE: so the consumer is surely awaiting before the return is stamped
            self.stamps[call] = time.time()
            return x

        def stamp(self, call: int) -> float:
            return self.stamps.pop(call)

    @ray.remote(num_cpus=0)
    class Consumer:
        """Stands in for the LLM replica: it gets the ObjectRef inside a list (not resolved by Ray) and awaits it."""

        async def take(self, refs: list) -> tuple[float, int]:
            x = await refs[0]
            return time.time(), x.numel() * x.element_size()

    return Producer, Consumer


def transfer(
    tokens: list[int], hiddens: list[int], dtypes: list[str], repeats: int, zero_copy: bool, ours: bool = False
) -> list[dict]:
    """Producer's `return` -> consumer holding the tensor, per (tokens, hidden, dtype), both actors on this node.

    The producer stamps time.time() just before returning; the consumer stamps it when `await ref` gives the
    tensor. Between the two: serializing the return value, storing it (shared memory above Ray's inline limit of
    100 KiB, else inline in the reply to the owner, here the driver), telling the owner, the consumer's fetch and
    deserialization. Same machine, same clock. The zero-token row is the floor that any object pays.

    `zero_copy`: Ray's RAY_ENABLE_ZERO_COPY_TORCH_TENSORS in the workers (a tensor goes out of band, as numpy
    arrays do; the receiver gets a read-only view of shared memory). Off by default in Ray 2.60.
    `ours`: the producer registers deployments/transfer.py's serializer, as the Encoder replicas do."""
    import ray

    env = {"PYTHONWARNINGS": "ignore"}  # with zero-copy, torch warns on each receiver that its tensor is read-only
    if zero_copy:
        env["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] = "1"
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        logging_level="warning",
        object_store_memory=512 * MIB,
        runtime_env={"env_vars": env},
    )
    try:
        Producer, Consumer = _actors()
        producer, consumer = Producer.remote(ours), Consumer.remote()
        call = 0

        def once(n: int, hidden: int, dtype: str) -> tuple[float, int]:
            nonlocal call
            call += 1
            ref = producer.make.remote(call, n, hidden, dtype)
            done, nbytes = ray.get(consumer.take.remote([ref]))
            return done - ray.get(producer.stamp.remote(call)), nbytes

        cases = [(0, hiddens[0], dtypes[0])] + [(n, h, d) for h in hiddens for d in dtypes for n in tokens]
        for case in cases:
            once(*case)  # warm-up: first use of each size and dtype
        # NOTE: round-robin over the cases, so a burst of other load on the shared machine hits them all alike.
        runs = [[once(*case) for case in cases] for _ in range(repeats)]
        rows = []
        for i, (n, hidden, dtype) in enumerate(cases):
            ms = statistics.median(run[i][0] for run in runs) * 1000
            nbytes = runs[0][i][1]
            rows.append(
                {
                    "tokens": n,
                    "hidden": hidden,
                    "dtype": dtype,
                    "MB": nbytes / 1e6,
                    "ms": ms,
                    "MB/s": nbytes / 1e6 / (ms / 1000) if nbytes else None,
                }
            )
        floor = rows[0]["ms"]
        for row in rows:
            row["ms over floor"] = row["ms"] - floor
        return rows
    finally:
        ray.shutdown()


def base64_decode(sizes: list[int], repeats: int) -> list[dict]:
    """stdlib `base64.b64decode(s, validate=True)` against pybase64's (which encoders/images.py uses), on a str
    payload as the JSON parser gives it."""
    rows = []
    for size in sizes:
        payload = base64.b64encode(os.urandom(size)).decode()
        stdlib_ms = median_ms(lambda: base64.b64decode(payload, validate=True), repeats)
        row = {"bytes": size, "stdlib ms": stdlib_ms, "stdlib MB/s": size / 1e6 / (stdlib_ms / 1000)}
        assert pybase64.b64decode(payload, validate=True) == base64.b64decode(payload, validate=True)
        fast_ms = median_ms(lambda: pybase64.b64decode(payload, validate=True), repeats)
        row |= {"pybase64 ms": fast_ms, "pybase64 MB/s": size / 1e6 / (fast_ms / 1000), "speedup": stdlib_ms / fast_ms}
        rows.append(row)
    return rows


__all__ = ["base64_decode", "elapsed_ms", "median_ms", "transfer"]
