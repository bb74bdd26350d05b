"""Prefix reuse and preemption: shared blocks give the same tokens as computing everything; images tell blocks apart."""

from __future__ import annotations

import asyncio

import pytest

from llm.engine import BlockPool
from tests.llm.reference import Case, collect, make_engine, reference_generate, request_for


def test_second_turn_reuses_the_first_turns_blocks(checkpoint, reference, model, vision):
    engine = make_engine(model, reference, block_size=4, num_blocks=256)
    first, ref1 = request_for(checkpoint, reference, vision, [(64, 48), (30, 100)], seed=1, prefix=list(range(3, 20)))
    out1, _ = asyncio.run(collect(engine, first))
    # The next turn re-sends the whole history (same text, same images) and adds to it.
    ids2 = first.request.prompt_token_ids + out1 + [21, 22, 23]
    second = first.replace(request_id="r2", prompt_token_ids=ids2)
    before = engine.stats()
    out2, _ = asyncio.run(collect(engine, second))
    hits = engine.stats()["prefix_hits"] - before["prefix_hits"]
    assert hits == (len(first.request.prompt_token_ids) + len(out1) - 1) // 4  # every full block of the history
    ref2 = dict(ref1, input_ids=ref1["input_ids"].new_tensor([ids2]))
    assert out2 == reference_generate(reference, ref2, max_new_tokens=12)


def test_the_first_chunk_tells_the_prompt_tokens_found_cached(checkpoint, reference, model, vision):
    engine = make_engine(model, reference, block_size=4, num_blocks=256)
    inp, _ = request_for(checkpoint, reference, vision, [(64, 48)], seed=5, prefix=list(range(3, 20)))

    async def cached() -> list[int | None]:
        return [chunk.num_cached_tokens async for chunk in engine.generate(inp.request, inp.embeds)]

    first, again, prompt = asyncio.run(cached()), asyncio.run(cached()), inp.request.prompt_token_ids
    assert first[0] == 0 and again[0] == (len(prompt) - 1) // 4 * 4  # all but the last token's block
    assert all(n is None for n in first[1:] + again[1:])


def test_same_tokens_different_image_is_not_a_hit(checkpoint, reference, model, vision):
    engine = make_engine(model, reference, block_size=4, num_blocks=256)
    a, ref_a = request_for(checkpoint, reference, vision, [(64, 48)], seed=2, prefix=[3, 4, 5, 6])
    b, ref_b = request_for(checkpoint, reference, vision, [(64, 48)], seed=3, prefix=[3, 4, 5, 6])
    assert a.request.prompt_token_ids == b.request.prompt_token_ids  # only the pixels differ
    assert [i.key for i in a.request.items] != [i.key for i in b.request.items]
    out_a, _ = asyncio.run(collect(engine, a))
    before = engine.stats()["prefix_hits"]
    out_b, _ = asyncio.run(collect(engine, b))
    assert engine.stats()["prefix_hits"] - before == 1  # the text block before the image, nothing after it
    assert out_a == reference_generate(reference, ref_a, 12) and out_b == reference_generate(reference, ref_b, 12)


def test_prefix_caching_off_computes_everything(checkpoint, reference, model, vision):
    engine = make_engine(model, reference, block_size=4, num_blocks=256, enable_prefix_caching=False)
    a, ref = request_for(checkpoint, reference, vision, [(64, 48)], seed=4, prefix=list(range(3, 12)))
    assert (
        asyncio.run(collect(engine, a))[0]
        == asyncio.run(collect(engine, a))[0]
        == reference_generate(reference, ref, 12)
    )
    assert engine.stats()["prefix_hits"] == 0


def test_preemption_under_a_small_cache_keeps_outputs_exact(checkpoint, reference, model, vision):
    """Eight requests that cannot all fit: some get preempted and recomputed, every answer is still exact."""
    requests = [
        request_for(
            checkpoint,
            reference,
            vision,
            [(40 + 20 * (i % 3), 40)] if i % 2 else [],
            seed=10 + i,
            prefix=list(range(3, 9 + i)),
            max_tokens=20,
        )
        for i in range(8)
    ]
    engine = make_engine(model, reference, block_size=4, num_blocks=40, max_model_len=120, enable_prefix_caching=False)

    async def together():
        return await asyncio.gather(*(collect(engine, inp) for inp, _ in requests))

    results = asyncio.run(together())
    assert engine.stats()["preemptions"] > 0
    for (_, ref), (ours, _) in zip(requests, results, strict=True):
        assert ours == reference_generate(reference, ref, max_new_tokens=20)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_block_pool_reference_counts_and_lru_eviction():
    pool = BlockPool(num_blocks=4, block_size=2)
    a = pool.allocate(2)
    pool.register(a[0], b"h0")
    pool.register(a[1], b"h1")
    assert pool.match_prefix([b"h0", b"h1", b"h2"]) == a
    pool.take(a)  # a second sequence shares them
    pool.release(a)
    assert pool.num_free == 2  # still held by the first
    pool.release(a)
    assert pool.num_free == 4 and pool.match_prefix([b"h0", b"h1"]) == a  # free, but still cached
    pool.allocate(3)  # the two never-used blocks go first, then the least recently freed: a[1] (the tail)
    assert pool.match_prefix([b"h0", b"h1"]) == [a[0]]
    with pytest.raises(MemoryError, match="2 KV blocks wanted, 1 free"):
        pool.allocate(2)


def test_a_cache_scope_keeps_its_blocks_to_itself(checkpoint, reference, model, vision):
    """The same prompt in two scopes (two tenants, or two cache_salts): no block in common, not even the text's;
    the same scope again: every full block. Outputs are the reference's either way."""
    engine = make_engine(model, reference, block_size=4, num_blocks=256)
    base, ref = request_for(checkpoint, reference, vision, [(64, 48)], seed=6, prefix=list(range(3, 20)))

    def scoped(request_id: str, scope: str) -> Case:
        return base.replace(request_id=request_id, cache_scope=scope)

    def cached(case: Case) -> tuple[int, list[int]]:
        async def run():
            chunks = [chunk async for chunk in engine.generate(case.request, case.embeds)]
            return chunks[0].num_cached_tokens, [t for c in chunks for t in c.token_ids]

        return asyncio.run(run())

    full = (len(base.request.prompt_token_ids) - 1) // 4 * 4
    assert cached(scoped("a1", "tenant-a"))[0] == 0
    assert cached(scoped("b1", "tenant-b"))[0] == 0  # another scope: a miss, text blocks included
    assert cached(scoped("s1", ""))[0] == 0  # nor the shared cache
    hit, out = cached(scoped("a2", "tenant-a"))
    assert hit == full and out == reference_generate(reference, ref, 12)  # the same scope keeps its hits
