"""The static decode step (engine/decode_step.py) against the eager step: logits over batch sizes that cross buckets,
prompts with images (a nonzero rope delta), a sequence at max_model_len, NaN in free blocks; greedy tokens against
transformers; no host sync inside the step; one graph under torch.compile(fullgraph=True); ops per layer."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from demo.op_count import OpCount
from llm.engine.decode_step import StaticDecode, bucket_for, buckets_up_to
from llm.model import BatchMeta, ChunkSpec, cpu_kernels
from tests.llm.reference import collect, make_engine, reference_generate, request_for

BS, MAX_LEN = 4, 96


def test_buckets():
    assert [bucket_for(n) for n in (1, 2, 3, 9, 17, 25, 33, 49, 64, 65, 97)] == [
        1,
        2,
        4,
        16,
        24,
        32,
        48,
        64,
        64,
        96,
        128,
    ]
    assert buckets_up_to(3) == [1, 2, 4] and buckets_up_to(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]


def _contexts(n: int, seed: int) -> list[int]:
    """n context lengths (tokens before the new one), one of them leaving the new token at max_model_len."""
    rng = random.Random(seed)
    return [MAX_LEN - 1] + [rng.randint(0, MAX_LEN - 2) for _ in range(n - 1)]


def _filled(model, starts: list[int], seed: int):
    """A cache with each sequence's first `start` keys written by eager prefill (random embeddings), its blocks
    scattered through the pool, every block no sequence holds (the null block too) full of NaN."""
    torch.manual_seed(seed)
    need = [s // BS + 1 for s in starts]
    cache = model.new_cache(sum(need) + 5, BS)  # the last block is the null block
    free = list(range(cache.num_blocks - 1))
    random.Random(seed).shuffle(free)
    blocks = [[free.pop() for _ in range(n)] for n in need]
    cache.kv.fill_(float("nan"))
    for b, s in zip(blocks, starts, strict=True):
        if s:
            x = torch.randn(s, model.config.hidden_size)
            model(x, torch.arange(s).expand(3, -1) + 7, cache, BatchMeta.build([ChunkSpec(b, 0, s)], BS, x.device))
    return cache, blocks


@pytest.mark.parametrize("n", [1, 2, 3, 9, 17, 64])
def test_static_step_equals_the_eager_step(model, n):
    starts = sorted(_contexts(n, seed=n))
    tokens = [random.Random(i).randint(3, 100) for i in range(n)]
    delta = 5  # as after an image: the position is the cache index + a rope delta
    with torch.inference_mode():
        cache, blocks = _filled(model, starts, seed=n)
        # NOTE: the eager step pads its gathers with block 0 and masks after the matmul, so it needs finite free
        # blocks (a cache that only ever held computed keys); the static step must not: it gets the NaN.
        eager_cache = KV = type(cache)(cache.kv.nan_to_num(0.0))
        meta = BatchMeta.build([ChunkSpec(b, s, 1) for b, s in zip(blocks, starts)], BS, torch.device("cpu"))
        pos = torch.tensor(starts).expand(3, -1) + delta
        eager = model.logits(model(model.embed(torch.tensor(tokens)), pos, KV, meta))
        static = StaticDecode(model, cache, max_num_seqs=64, max_model_len=MAX_LEN, cuda_graphs=False)
        rows = static.prepare(tokens, [s + delta for s in starts], blocks, [s + 1 for s in starts])
        assert rows == bucket_for(n)
        logits = static.run(n, rows)
    # Random embeddings of std 1 make large activations: float32 noise of a few 1e-5 of the logits' scale (~8).
    torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-3)
    assert torch.equal(logits.argmax(-1), eager.argmax(-1))
    assert torch.isfinite(logits).all()
    # The new keys landed where the eager step put them; every other slot (free blocks, padding) is untouched.
    written = ~torch.isnan(cache.kv)
    slots = written.any(-1).any(1).any(0)  # (num_blocks, block_size): token slots holding anything
    assert slots[:-1].sum() == sum(starts) + n  # the prefills' keys and the n new ones: nothing else
    assert slots[-1].tolist() == [rows > n, False, False, False]  # padding rows write the null block's first slot
    pool = written[:, :, :-1]  # the pool's blocks (the null block's slot is the padding's alone)
    torch.testing.assert_close(cache.kv[:, :, :-1][pool], eager_cache.kv[:, :, :-1][pool], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("case", [[(64, 48)], [(30, 200), (120, 60)]])
def test_greedy_through_the_static_step_matches_transformers(checkpoint, reference, model, vision, case):
    inp, ref = request_for(checkpoint, reference, vision, case, seed=3, prefix=[11, 12, 13], max_tokens=20)
    engine = make_engine(model, reference, static_decode=True)
    assert engine.runner.static is not None
    ours, _ = asyncio.run(collect(engine, inp))
    assert ours == reference_generate(reference, ref, max_new_tokens=20)


class _NoHostSync(TorchDispatchMode):
    """Fails on any op that reads a tensor's value on the host (what a CUDA graph cannot hold)."""

    SYNCS = ("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.equal", "aten.is_nonzero")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) in self.SYNCS:
            raise AssertionError(f"host sync inside the decode step: {func}")
        return func(*args, **(kwargs or {}))


def test_the_step_has_no_host_sync(model):
    starts = [3, 10, 40]
    with torch.inference_mode():
        cache, blocks = _filled(model, starts, seed=1)
        static = StaticDecode(model, cache, max_num_seqs=8, max_model_len=MAX_LEN, cuda_graphs=False)
        rows = static.prepare([5, 6, 7], starts, blocks, [s + 1 for s in starts])
        with _NoHostSync():
            eager = static.forward(rows)
        with pytest.raises(AssertionError, match="host sync"), _NoHostSync():
            eager[0, 0].item()  # the mode does catch one


def test_ops_per_layer_in_a_decode_step(model):
    """Ops one decoder layer dispatches in an eager decode step of one sequence: the step's count with both layers
    less its count with the first alone. NOTE: 48 before the fused layers (llm/model/layers.py says what fused); 9 with
    llm/model/cpu_kernels.cpp's add+RMSNorm, RoPE with the KV write, SiLU-mul and in-place attention (11 before the
    last two), 20 with torch's ops alone."""
    assert cpu_kernels.load() is not None
    blocks = list(range(12))
    x, pos = torch.randn(1, model.config.hidden_size), torch.tensor([40]).expand(3, -1)
    counts, layers = [], model.layers
    try:
        for n in (2, 1):
            model.layers = layers[:n]
            kernel_calls = cpu_kernels.calls
            with torch.inference_mode(), OpCount() as ops:
                model(x, pos, model.new_cache(16, BS), BatchMeta.build([ChunkSpec(blocks, 40, 1)], BS, x.device))
            counts.append(ops.n + cpu_kernels.calls - kernel_calls)  # the CPU kernels' calls count as ops too
    finally:
        model.layers = layers
    assert counts[0] - counts[1] <= (9 if cpu_kernels.available() else 20), counts


@pytest.mark.slow
def test_the_compiled_step_equals_the_eager_step_across_buckets(model):
    """`llm.compile_decode`: one compile for every bucket (symbolic rows), the same logits as the eager step."""
    starts = sorted(_contexts(9, seed=4))
    with torch.inference_mode():
        cache, blocks = _filled(model, starts, seed=4)
        static = StaticDecode(model, cache, max_num_seqs=16, max_model_len=MAX_LEN, cuda_graphs=False, compiled=True)
        assert static.step != static.forward  # compiled, not fallen back to eager (bound methods: ==, not is)
        for n in (1, 3, 9):
            cache.kv.nan_to_num_(0.0)  # the step's keys of an earlier round stay: both steps see the same cache
            rows = static.prepare(list(range(5, 5 + n)), starts[:n], blocks[:n], [s + 1 for s in starts[:n]])
            torch.testing.assert_close(static.run(n, rows), static.forward(rows)[:n], rtol=1e-4, atol=1e-3)


@pytest.mark.slow  # torch.compile of the whole step
def test_the_step_compiles_to_one_graph_that_writes_the_cache_in_place(model):
    """fullgraph: a graph break raises. The compiled step's logits are the eager step's, and its KV write is an op of
    its own (attention.kv_write), written in place: as index_copy_ on a view of the cache it was functionalized into
    copies of the cache and a whole-cache copy back every step."""
    from torch._inductor.utils import run_and_get_code

    starts = [3, 10, 40]
    with torch.inference_mode():
        cache, blocks = _filled(model, starts, seed=2)
        static = StaticDecode(model, cache, max_num_seqs=4, max_model_len=MAX_LEN, cuda_graphs=False)
        rows = static.prepare([5, 6, 7], starts, blocks, [s + 1 for s in starts])
        eager = static.forward(rows)  # it writes the step's keys; the compiled step writes the same ones again
        before = cache.kv.data_ptr()
        torch._dynamo.reset()
        compiled, code = run_and_get_code(torch.compile(static.forward, fullgraph=True, dynamic=False), rows)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    code = "\n".join(code)
    assert code.count("llm.kv_write.default(") == model.config.num_layers
    assert "copy__view" not in code and cache.kv.data_ptr() == before
