"""One request's settings never cost another request its answer: whatever sampling settings the API lets through
(and grammars, some of which lead nowhere), a greedy request batched with them gets the tokens it gets alone, and
the others end with their tokens or, for a grammar that leads nowhere, an InvalidRequest. A property test over the
engine: a grammar that dead-ended once failed every sequence of its step."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from schemas import GenerateRequest, InvalidRequest, SamplingParams
from tests.llm.reference import collect, make_engine

VOCAB = 1024  # the tiny checkpoint's BPE vocabulary (demo/build_tiny.py); its logits are wider (padded)
GRAMMARS = [None, 'root ::= "a" | "b" "c"', "root ::= root", 'root ::= "a" x\nx ::= x', "root ::= [0-9]+"]


@pytest.fixture(scope="module")
def engine(model, reference, checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert model.config.vocab_size >= VOCAB
    return make_engine(model, reference, load_tokenizer=lambda: tokenizer)


def _params(max_tokens: int) -> st.SearchStrategy[SamplingParams]:
    """Every SamplingParams the ingress can make (deployments/ingress/prepare.py `sampling_params`): the API's
    ranges, temperatures below 1e-5 already greedy."""
    ids = st.integers(0, VOCAB - 1)
    return st.builds(
        SamplingParams,
        max_tokens=st.just(max_tokens),
        temperature=st.one_of(st.just(0.0), st.floats(1e-5, 2.0)),
        top_p=st.floats(0.0, 1.0, exclude_min=True),
        top_k=st.integers(0, 50),
        seed=st.integers(0, 2**63 - 1),
        presence_penalty=st.floats(-2.0, 2.0),
        frequency_penalty=st.floats(-2.0, 2.0),
        repetition_penalty=st.floats(0.0, 1e300, exclude_min=True),
        min_p=st.floats(0.0, 1.0),
        min_tokens=st.integers(0, max_tokens),
        logit_bias=st.dictionaries(ids, st.floats(-100.0, 100.0), max_size=4),
        stop_token_ids=st.frozensets(ids, max_size=3),
        ignore_eos=st.booleans(),
        logprobs=st.booleans(),
        top_logprobs=st.integers(0, 20),
        grammar=st.sampled_from(GRAMMARS),
    )


def _greedy(i: int) -> GenerateRequest:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return GenerateRequest(request_id=f"g{i}", prompt_token_ids=[5, 6, 7], sampling=params)


@settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(others=st.lists(_params(8), min_size=1, max_size=4))
def test_a_greedy_request_gets_its_answer_whatever_its_neighbours_ask(engine, others):
    alone = asyncio.run(collect(engine, _greedy(0)))
    failed = engine.counts["failed"]

    async def together():
        requests = [
            GenerateRequest(request_id=f"o{i}", prompt_token_ids=[9, 10 + i], sampling=p) for i, p in enumerate(others)
        ]
        return await asyncio.gather(
            collect(engine, _greedy(1)), *(collect(engine, r) for r in requests), return_exceptions=True
        )

    mine, *theirs = asyncio.run(together())
    assert mine == alone, (mine, others)
    for outcome, params in zip(theirs, others, strict=True):
        if isinstance(outcome, BaseException):  # only a grammar that leads nowhere is the request's own fault
            assert isinstance(outcome, InvalidRequest) and params.grammar in GRAMMARS[2:4], (repr(outcome), params)
        else:
            ids, finish = outcome
            assert finish in ("stop", "length") and all(0 <= t < engine.grammars.vocab_size for t in ids), outcome
    assert engine.counts["failed"] == failed
