"""Tensor parallelism without Ray: each rank's shard, and two gloo ranks (this process and a child) giving the same
greedy tokens as one rank and as transformers; a rank that dies fails the engine's requests, never hangs them."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from demo.build_tiny import build_checkpoint
from demo.local import free_port
from demo.tiny_llava import build_llava_checkpoint
from demo.tiny_qwen3_vl import build_qwen3_vl_checkpoint
from encoders import Qwen2VLVisionEncoder
from encoders.qwen3_vl import Qwen3VLVisionEncoder
from llm import Qwen2LM
from llm.model.attention import BatchMeta, ChunkSpec
from llm.model.parallel import ParallelLM, RankFailure, TPGroup, init_process_group, serve_rank
from schemas import Overloaded
from tests.llm.reference import collect, make_engine, reference_generate, request_for

pytestmark = pytest.mark.slow  # every test here starts gloo rank processes

CPU = torch.device("cpu")


def _follow(checkpoint: str, init_method: str, rank: int, world_size: int) -> None:
    """Rank 1..N-1, in a child process."""
    torch.set_num_threads(1)
    init_process_group(rank, world_size, init_method, CPU, timeout_s=60)
    serve_rank(Qwen2LM.from_pretrained(checkpoint, tp=TPGroup(rank, world_size)))
    dist.destroy_process_group()


@contextmanager
def ranks(checkpoint, world_size: int) -> Iterator[tuple[ParallelLM, list]]:
    """(rank 0's ParallelLM in this process, the child processes of ranks 1..N-1)."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    spawn = mp.get_context("spawn")
    children = [
        spawn.Process(target=_follow, args=(str(checkpoint), init_method, r, world_size), daemon=True)
        for r in range(1, world_size)
    ]
    for child in children:
        child.start()
    init_process_group(0, world_size, init_method, CPU, timeout_s=60)
    try:
        group = TPGroup(0, world_size)
        yield ParallelLM(Qwen2LM.from_pretrained(checkpoint, tp=group)), children
    finally:
        for child in children:
            if child.is_alive():
                child.kill()
            child.join(30)
        if dist.is_initialized():  # a failed step has left the group already
            dist.destroy_process_group()


@pytest.fixture
def two_ranks(checkpoint):
    with ranks(checkpoint, 2) as (parallel, children):
        yield parallel, children[0]


@pytest.fixture(scope="module")
def odd_checkpoint(tmp_path_factory):
    """6 heads, 3 KV heads, tied embeddings: three ranks, and a vocabulary (1088) that 3 does not divide."""
    return build_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "odd",
        seed=2,
        hidden_size=48,
        num_heads=6,
        num_kv_heads=3,
        intermediate_size=96,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def llava_checkpoint(tmp_path_factory):
    return build_llava_checkpoint(tmp_path_factory.mktemp("llava") / "hub")


@pytest.mark.parametrize(("name", "world_size"), [("odd_checkpoint", 3), ("llava_checkpoint", 2)])
def test_ranks_give_the_logits_of_one(request, name, world_size):
    """Tied embeddings and a short last vocabulary slice (Qwen2), no biases and 1-D RoPE (Llama)."""
    checkpoint = request.getfixturevalue(name)
    whole = Qwen2LM.from_pretrained(checkpoint)
    ids = torch.tensor([5, 9, 11, 13, 2, 7, 30, 31, 40, 41, 3])
    positions = torch.arange(len(ids)).expand(3, -1)
    meta = lambda: BatchMeta.build([ChunkSpec(list(range(4)), 0, len(ids))], 16, CPU)  # noqa: E731
    with torch.inference_mode():
        expected = whole.logits(whole(whole.embed(ids), positions, whole.new_cache(8, 16), meta()))
        with ranks(checkpoint, world_size) as (parallel, _):
            parallel.new_cache(8, 16)
            cache = parallel.local.new_cache(8, 16)
            ours = parallel.logits(parallel(parallel.embed(ids), positions, cache, meta()), list(range(len(ids))))
            parallel.close()
    assert ours.shape == expected.shape == (len(ids), whole.config.vocab_size)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


def test_each_rank_reads_only_its_slices(checkpoint, model):
    c = model.config
    for rank in (0, 1):
        shard = Qwen2LM.from_pretrained(checkpoint, tp=TPGroup(rank, 2))
        attn, mlp = shard.layers[0].self_attn, shard.layers[0].mlp
        heads, kv, inter = (
            slice(rank * c.num_heads // 2 * c.head_dim, (rank + 1) * c.num_heads // 2 * c.head_dim),
            slice(rank * c.num_kv_heads // 2 * c.head_dim, (rank + 1) * c.num_kv_heads // 2 * c.head_dim),
            slice(rank * c.intermediate_size // 2, (rank + 1) * c.intermediate_size // 2),
        )
        full_attn, full_mlp = model.layers[0].self_attn, model.layers[0].mlp
        full_qkv, full_gu = model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.gate_up_proj
        nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim  # the fused rows: q, then k, then v
        for part in ("weight", "bias"):
            whole = getattr(full_qkv, part)
            q, k, v = whole[:nq], whole[nq : nq + nk], whole[nq + nk :]
            torch.testing.assert_close(
                getattr(attn.qkv_proj, part), torch.cat([q[heads], k[kv], v[kv]]), rtol=0, atol=0
            )
        torch.testing.assert_close(attn.o_proj.weight, full_attn.o_proj.weight[:, heads], rtol=0, atol=0)
        gate, up = full_gu.weight.chunk(2)
        torch.testing.assert_close(mlp.gate_up_proj.weight, torch.cat([gate[inter], up[inter]]), rtol=0, atol=0)
        torch.testing.assert_close(mlp.down_proj.weight, full_mlp.down_proj.weight[:, inter], rtol=0, atol=0)
        half = -(-c.vocab_size // 2)
        torch.testing.assert_close(
            shard.lm_head.weight, model.lm_head.weight[rank * half : (rank + 1) * half], rtol=0, atol=0
        )
        assert (shard.embed_tokens is None) == (rank == 1)  # rank 0 embeds for everyone
        assert shard.new_cache(4, 16).k.shape[1] == c.num_kv_heads // 2  # the KV cache follows the heads


def test_a_rank_reads_no_more_than_its_shard_from_disk(checkpoint, monkeypatch):
    import encoders.weights as ckpt

    read = []

    class Recording:  # safe_open, counting the elements that leave the file
        def __init__(self, *args, **kwargs):
            self.f = ckpt_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, key):
            read.append(t := self.inner.get_tensor(key))
            return t

        def get_slice(self, key):
            part = self.inner.get_slice(key)
            return type(
                "Part", (), {"get_shape": part.get_shape, "__getitem__": lambda _, i: read.append(t := part[i]) or t}
            )()

    ckpt_open = ckpt.safe_open
    monkeypatch.setattr(ckpt, "safe_open", Recording)
    shard = Qwen2LM.from_pretrained(checkpoint, tp=TPGroup(1, 2))
    held = sum(p.numel() for p in shard.parameters())
    assert sum(t.numel() for t in read) == held  # every element read is one this rank holds (no padding here)


def test_a_split_that_does_not_divide_is_refused(checkpoint):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        Qwen2LM.from_pretrained(checkpoint, tp=TPGroup(0, 3))


def test_two_ranks_give_the_logits_and_greedy_tokens_of_one(checkpoint, reference, model, vision, two_ranks):
    parallel, _ = two_ranks
    parallel.new_cache(64, 16)
    inp, ref = request_for(checkpoint, reference, vision, [(64, 48)], seed=3, prefix=[11, 12, 13])
    ids = torch.tensor(inp.request.prompt_token_ids)
    # One prefill through both: the logits agree to float32 rounding, which is relative to the logits' scale (the
    # ranks sum their partial products in another order; 1.1e-4 seen on logits of up to 23.5, on a VM without AVX-512).
    with torch.inference_mode():
        embeds = model.embed(ids)
        positions = torch.arange(len(ids)).expand(3, -1)
        meta = lambda: BatchMeta.build([ChunkSpec(list(range(8)), 0, len(ids))], 16, CPU)  # noqa: E731
        one = model.logits(model(embeds, positions, model.new_cache(64, 16), meta()), [len(ids) - 1])
        cache = parallel.local.new_cache(64, 16)
        two = parallel.logits(parallel(embeds, positions, cache, meta()), [len(ids) - 1])
    torch.testing.assert_close(two, one, rtol=1e-4, atol=1e-5 * one.abs().max().item())

    # Mixed batches through the engine, images included: transformers' tokens exactly.
    requests = [
        request_for(checkpoint, reference, vision, sizes, seed=i, prefix=list(range(3, 4 + 2 * i)))
        for i, sizes in enumerate([[], [(64, 48)], [(30, 200), (120, 60)]])
    ]
    engine = make_engine(parallel, reference, max_num_batched_tokens=64, num_blocks=64)

    async def together():
        return await asyncio.gather(*(collect(engine, inp) for inp, _ in requests))

    for (inp, ref), (ours, _) in zip(requests, asyncio.run(together()), strict=True):
        assert ours == reference_generate(reference, ref, max_new_tokens=inp.request.sampling.max_tokens)
    engine.close()


def test_two_ranks_add_qwen3_vls_deepstack_levels_as_one(tmp_path_factory):
    """Qwen3-VL over two ranks: each holds the whole hidden state, so each adds the step's DeepStack features, sent
    with its embeddings (ParallelLM): transformers' greedy tokens, in chunks of 7 that cut the images. (Seed 2: there
    the tokens change when the levels are zeroed: tests/llm/test_qwen3_vl.py.)"""
    from transformers import Qwen3VLForConditionalGeneration

    ckpt = build_qwen3_vl_checkpoint(tmp_path_factory.mktemp("qwen3-vl") / "tiny", seed=2)
    reference = Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    inp, ref = request_for(
        ckpt, reference, Qwen3VLVisionEncoder(ckpt), [(120, 80), (64, 200)], seed=1, prefix=[3, 4, 5], max_tokens=6
    )
    expected = reference_generate(reference, ref, max_new_tokens=6)
    # One prefill with random levels at some rows: the ranks' logits are one rank's (a rank that skipped the features
    # would compute its heads and its vocabulary slice from another hidden state)
    whole, ids = Qwen2LM.from_pretrained(ckpt), torch.arange(3, 30)
    rows, features = torch.tensor([4, 5, 6, 9]), torch.randn(4, 2, 64, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(len(ids)).expand(3, -1)
    meta = lambda: BatchMeta.build([ChunkSpec(list(range(4)), 0, len(ids))], 16, CPU)  # noqa: E731
    with torch.inference_mode():
        stack = (rows, 500 * features)  # at the scale of the hidden states where they are added
        one = whole.logits(whole(whole.embed(ids), positions, whole.new_cache(8, 16), meta(), stack))
    with ranks(ckpt, 2) as (parallel, _):
        with torch.inference_mode():
            parallel.new_cache(8, 16)
            hidden = parallel(parallel.embed(ids), positions, parallel.local.new_cache(8, 16), meta(), stack)
            two = parallel.logits(hidden, list(range(len(ids))))
        torch.testing.assert_close(two, one, rtol=1e-4, atol=1e-5 * one.abs().max().item())
        engine = make_engine(parallel, reference, max_num_batched_tokens=7, max_model_len=512, num_blocks=64)
        try:
            assert asyncio.run(collect(engine, inp))[0] == expected
        finally:
            engine.close()


def test_three_ranks_give_the_greedy_tokens_of_one_and_of_transformers(odd_checkpoint):
    """Mixed batches through the engine, images included, on three ranks (6 heads, 3 KV heads, a vocabulary 3 does
    not divide): the tokens of the one-rank engine, and transformers' tokens."""
    from transformers import Qwen2VLForConditionalGeneration

    reference = Qwen2VLForConditionalGeneration.from_pretrained(odd_checkpoint, dtype=torch.float32).eval()
    vision = Qwen2VLVisionEncoder(odd_checkpoint)
    requests = [
        request_for(odd_checkpoint, reference, vision, sizes, seed=i, prefix=list(range(3, 4 + 2 * i)))
        for i, sizes in enumerate([[], [(64, 48)], [(30, 200), (120, 60)]])
    ]
    expected = [
        reference_generate(reference, ref, max_new_tokens=inp.request.sampling.max_tokens) for inp, ref in requests
    ]

    def generate(model) -> list[list[int]]:
        engine = make_engine(model, reference, max_num_batched_tokens=64, num_blocks=64)

        async def together():
            return await asyncio.gather(*(collect(engine, inp) for inp, _ in requests))

        try:
            return [ids for ids, _ in asyncio.run(together())]
        finally:
            engine.close()

    assert generate(Qwen2LM.from_pretrained(odd_checkpoint)) == expected
    with ranks(odd_checkpoint, 3) as (parallel, _):
        assert generate(parallel) == expected


def test_a_dead_rank_fails_requests_and_stops_the_engine(checkpoint, reference, vision, two_ranks):
    parallel, child = two_ranks
    engine = make_engine(parallel, reference, num_blocks=64)
    inp, _ = request_for(checkpoint, reference, vision, [], seed=1, prefix=[5, 6, 7])
    assert len(asyncio.run(collect(engine, inp))[0]) == inp.request.sampling.max_tokens
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    deadline = time.monotonic() + 90  # the idle engine's keepalive finds the dead rank without a request
    while engine.dead is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert engine.dead is not None
    with pytest.raises(Overloaded, match="lost a tensor-parallel rank"):
        asyncio.run(collect(engine, inp))


def test_a_failed_step_on_rank_0_releases_the_other_ranks_at_once(checkpoint, two_ranks):
    parallel, child = two_ranks
    parallel.new_cache(8, 16)
    ids = torch.tensor([5, 6, 7])
    meta = BatchMeta.build([ChunkSpec([0], 0, 3)], 16, CPU)

    def broken(*args):
        raise torch.OutOfMemoryError("no memory for this step")

    parallel.local.forward = broken  # the other rank is already inside the step, waiting on an all-reduce
    started = time.monotonic()
    with pytest.raises(RankFailure, match="no memory for this step"):
        parallel(parallel.embed(ids), torch.arange(3).expand(3, -1), parallel.local.new_cache(8, 16), meta)
    child.join(30)
    elapsed = time.monotonic() - started
    assert child.exitcode not in (None, 0) and elapsed < 30, elapsed  # not the 60 s collective timeout
