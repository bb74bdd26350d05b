"""Structured outputs in the engine: the bitmask step against xgrammar's own kernel, the sampler under a mask (a
masked token is never sampled, free rows untouched), and whole generations of the tiny random model, whose free
output is garbage: under a JSON schema it must parse and validate, mixed in one batch with free requests."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from deployments.ingress.structured import json_grammar
from llm.engine import sample
from llm.engine.grammar import apply_bitmask
from schemas import GenerateRequest, InvalidRequest, SamplingParams
from tests.llm.reference import collect, make_engine, states_for

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "box": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "label": {"type": "string", "maxLength": 12}},
            "required": ["x", "label"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["colour", "count", "box", "tags"],
    "additionalProperties": False,
}


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """(B, V) bool -> xgrammar's (B, ceil(V / 32)) int32 layout, built by xgrammar's own matcher-free helper."""
    B, V = allowed.shape
    bitmask = xgr.allocate_token_bitmask(B, V)
    bitmask.zero_()
    for b, v in allowed.nonzero().tolist():
        word = int(bitmask[b, v // 32]) & 0xFFFFFFFF | (1 << (v % 32))
        bitmask[b, v // 32] = word - (1 << 32) if word >= 1 << 31 else word
    return bitmask


def test_apply_bitmask_equals_xgrammar_and_leaves_other_rows_alone():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 100, generator=gen)
    allowed = torch.rand(4, 100, generator=gen) < 0.3
    bitmask, rows = _bitmask(allowed), [0, 2]
    ours, ref = logits.clone(), logits.clone()
    apply_bitmask(ours, bitmask, rows)
    xgr.apply_token_bitmask_inplace(ref, bitmask, indices=rows)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])
    assert torch.isinf(ours[0][~allowed[0]]).all() and torch.equal(ours[0][allowed[0]], logits[0][allowed[0]])


def test_a_masked_token_is_never_sampled_and_free_rows_are_unchanged():
    V = 64
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=gen) * 3
    allowed = torch.zeros(3, V, dtype=torch.bool)
    allowed[:, 5:9] = True  # the best tokens of the rows lie elsewhere, almost surely
    mask = (_bitmask(allowed), [0, 1])
    params = [
        SamplingParams(8, temperature=0.0),
        SamplingParams(8, temperature=1.5, seed=1),
        SamplingParams(8, temperature=0.0),
    ]
    free, _ = sample(logits.clone(), params, [None, None, None], states_for(params, V))
    for seed in range(20):
        gens = [None, torch.Generator().manual_seed(seed), None]
        tokens, _ = sample(logits.clone(), params, gens, states_for(params, V), mask)
        assert 5 <= tokens[0] < 9 and 5 <= tokens[1] < 9
        assert tokens[2] == free[2]  # the free row, exactly as without a grammar
    assert tokens[0] == 5 + int(logits[0, 5:9].argmax())  # greedy under the mask: the best allowed token
    assert not 5 <= free[0] < 9  # the claim above is not vacuous


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def engine(model, reference, tokenizer):
    return make_engine(model, reference, load_tokenizer=lambda: tokenizer)


def _request(i: int, grammar: str | None, **sampling) -> GenerateRequest:
    params = SamplingParams(**{"max_tokens": 200, "temperature": 0.0, "grammar": grammar, **sampling})
    return GenerateRequest(request_id=f"r{i}", prompt_token_ids=[5, 6, 7, 8 + i], sampling=params)


def test_schema_output_validates_mixed_with_free_requests(engine, tokenizer):
    """Greedy and sampled (several seeds) under the schema, beside free greedy requests in the same steps: every
    constrained answer is valid JSON under the schema and ends with EOS; every free one equals its run alone."""
    grammar = json_grammar(SCHEMA, "response_format")
    free_alone = [asyncio.run(collect(engine, _request(i, None, max_tokens=24))) for i in range(3)]

    async def together():
        constrained = [_request(0, grammar)] + [_request(i, grammar, temperature=1.0, seed=i) for i in range(1, 5)]
        free = [_request(i, None, max_tokens=24) for i in range(3)]
        return await asyncio.gather(*(collect(engine, r) for r in constrained + free))

    results = asyncio.run(together())
    for ids, finish in results[:5]:
        assert finish == "stop" and ids[-1] in engine.eos_token_ids, (finish, tokenizer.decode(ids))
        jsonschema.validate(json.loads(tokenizer.decode(ids, skip_special_tokens=True)), SCHEMA)
    assert results[5:] == free_alone
    assert not _parses(tokenizer.decode(free_alone[0][0], skip_special_tokens=True))  # garbage without it


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def test_a_grammar_cut_by_max_tokens_is_length_and_compiles_once(engine, tokenizer):
    grammar = json_grammar(SCHEMA, "response_format")
    ids, finish = asyncio.run(collect(engine, _request(0, grammar, max_tokens=5)))
    assert finish == "length" and len(ids) == 5 and '{"colour": "'.startswith(tokenizer.decode(ids))
    compiled = engine.grammars.num_compiled
    asyncio.run(collect(engine, _request(1, grammar, max_tokens=5)))
    assert compiled >= 1 and engine.grammars.num_compiled == compiled  # the second request found it cached


def test_an_engine_without_a_tokenizer_refuses_grammars(model, reference):
    with pytest.raises(InvalidRequest, match="structured outputs"):
        asyncio.run(collect(make_engine(model, reference), _request(0, json_grammar(SCHEMA, "response_format"))))


# A grammar whose language is empty: no token can start it.
NOTHING = "root ::= root"
# One whose every derivation dead-ends after "a": its first token is allowed, then none is.
DEAD_END = 'root ::= "a" x\nx ::= x'


def test_a_grammar_that_matches_no_text_is_refused_before_it_runs(engine):
    steps = engine.counts["steps"]
    with pytest.raises(InvalidRequest, match="no token can start") as e:
        asyncio.run(collect(engine, _request(0, NOTHING)))
    assert e.value.status == 400 and engine.counts["steps"] == steps  # no step ran for it


def test_a_grammar_that_dead_ends_fails_its_own_request_alone(engine, tokenizer):
    """Its first token is sampled, then its grammar allows none: that request ends with a 400 naming the point; the
    free requests in the same steps get their tokens as alone, and the engine serves on."""
    free_alone = [asyncio.run(collect(engine, _request(i, None, max_tokens=24))) for i in range(3)]
    failed = engine.counts["failed"]

    async def together():
        free = [_request(i, None, max_tokens=24) for i in range(3)]
        return await asyncio.gather(
            *(collect(engine, r) for r in [_request(9, DEAD_END), *free]), return_exceptions=True
        )

    bad, *free = asyncio.run(together())
    assert isinstance(bad, InvalidRequest) and bad.status == 400, repr(bad)
    assert "allows no token after 1 generated" in bad.message, bad.message
    assert free == free_alone
    assert engine.counts["failed"] == failed  # the client's grammar, not an engine fault
    assert asyncio.run(collect(engine, _request(0, None, max_tokens=4)))[1] == "length"


def test_a_token_off_a_live_grammar_is_ours_not_the_clients(engine):
    """The refusal tells a dead end (the client's grammar: a 400) from a token sampled against a mask that allowed
    others (an engine fault: not a 400)."""
    from llm.engine.grammar import new_matcher

    grammars = engine.grammars
    live = new_matcher(grammars.compile('root ::= "a" | "b"'))
    assert type(grammars.refusal(live, 0, 0)) is RuntimeError
    dead = new_matcher(grammars.compile(DEAD_END))
    dead.fill_next_token_bitmask(bitmask := xgr.allocate_token_bitmask(1, grammars.vocab_size), 0)
    assert dead.accept_token(first := int(_allowed(bitmask, grammars.vocab_size)[0]))
    assert isinstance(error := grammars.refusal(dead, first, 1), InvalidRequest) and error.status == 400


def _allowed(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    return [v for v in range(vocab_size) if (int(bitmask[0, v // 32]) >> (v % 32)) & 1]
