"""The request's sampling fields at the ingress: the checkpoint's generation_config.json defaults for the fields a
request leaves out (vLLM's `--generation-config auto`), the 400s of logit_bias and min_tokens, and what reaches
the engine."""

from __future__ import annotations

import json
import shutil

import pytest

from deployments.ingress.http import parse
from deployments.ingress.prepare import Preparer, sampling_params
from encoders import ModelSpec
from schemas import AppArgs, InvalidRequest
from schemas.openai import ChatCompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]
GENERATION = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "min_p": 0.02}


@pytest.fixture(scope="module")
def tuned_checkpoint(checkpoint, tmp_path_factory):
    """The tiny checkpoint whose generation_config.json sets sampling values, as Qwen2.5-VL's does."""
    out = tmp_path_factory.mktemp("tuned") / "qwen2-vl-tiny"
    shutil.copytree(checkpoint, out)
    path = out / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **GENERATION, "do_sample": True}))
    return out


def _params(spec: ModelSpec, **fields):
    req = parse(ChatCompletionRequest, {"messages": MESSAGES, **fields})
    return sampling_params(req, 16, 0, None, spec.sampling_defaults)


def test_left_out_fields_take_the_checkpoints_generation_config(tuned_checkpoint):
    spec = ModelSpec.load(tuned_checkpoint, device="cpu")
    assert spec.sampling_defaults == GENERATION
    p = _params(spec)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.min_p) == (0.7, 0.8, 20, 1.05, 0.02)
    nulls = _params(spec, **dict.fromkeys(GENERATION))  # null is "left out", as the openai client sends None
    assert (nulls.temperature, nulls.top_p, nulls.top_k, nulls.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    given = _params(spec, temperature=0, top_p=1.0, top_k=-1, repetition_penalty=1.0, min_p=0.0)
    assert (given.temperature, given.top_p, given.top_k, given.repetition_penalty, given.min_p) == (0, 1, 0, 1, 0)


def test_without_generation_config_values_or_with_vllm_the_api_defaults_apply(checkpoint, tuned_checkpoint):
    for spec in (
        ModelSpec.load(checkpoint, device="cpu"),  # its generation_config.json sets no sampling value
        ModelSpec.from_args(AppArgs(model=str(tuned_checkpoint), generation_config="vllm")),
    ):
        assert spec.sampling_defaults == {}
        p = _params(spec)
        assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.min_p) == (1.0, 1.0, 0, 1.0, 0.0)


def test_a_generation_config_out_of_range_fails_at_load(tuned_checkpoint, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tuned_checkpoint, bad)
    path = bad / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "top_p": 0.0}))
    with pytest.raises(ValueError, match="out of range"):
        ModelSpec.load(bad, device="cpu")


def test_the_new_fields_reach_the_engine():
    req = parse(
        ChatCompletionRequest,
        {"messages": MESSAGES, "logit_bias": {"5": 100, "7": -2.5}, "min_tokens": 3, "min_p": 0.1,
         "repetition_penalty": 1.2},
    )  # fmt: skip
    p = sampling_params(req, 16, 0, None, {})
    assert (p.logit_bias, p.min_tokens, p.min_p, p.repetition_penalty) == ({5: 100.0, 7: -2.5}, 3, 0.1, 1.2)


@pytest.fixture(scope="module")
def prep(checkpoint) -> Preparer:
    return Preparer(AppArgs(model=str(checkpoint), llm={"max_model_len": 160}))


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"logit_bias": {"99999": 5}}, "logit_bias", "token id 99999 is outside the vocabulary of"),
        ({"logit_bias": {"-1": 5}}, "logit_bias", "token id -1 is outside"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5", "less than or equal to 100"),
        ({"logit_bias": {"five": 1}}, "logit_bias.five", "valid integer"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "min_tokens 9 is over max_tokens 8"),
        ({"min_tokens": 500}, "min_tokens", "tokens left in the context after the prompt"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
    ],
)
def test_bad_values_are_400s_naming_their_field(prep, fields, param, says):
    with pytest.raises(InvalidRequest) as e:
        req = parse(ChatCompletionRequest, {"messages": MESSAGES, **fields})
        prep.check(req)
        prep.prepare(req, {})
    assert e.value.status == 400 and e.value.param == param and says in e.value.message, e.value.message


def test_the_vocabulary_is_the_tokenizers_within_the_logits(prep, checkpoint):
    from transformers import AutoTokenizer

    n = len(AutoTokenizer.from_pretrained(checkpoint))
    assert prep.vocab_size == n  # the tiny config pads its logits past the tokenizer: those ids are no tokens
    prep.check(parse(ChatCompletionRequest, {"messages": MESSAGES, "logit_bias": {str(n - 1): 1}}))
    with pytest.raises(InvalidRequest):
        prep.check(parse(ChatCompletionRequest, {"messages": MESSAGES, "logit_bias": {str(n): 1}}))


@pytest.mark.parametrize(("temperature", "used"), [(1e-300, 0.0), (9e-6, 0.0), (1e-5, 1e-5), (0.5, 0.5)])
def test_a_temperature_below_vllms_epsilon_is_greedy(temperature, used):
    req = parse(ChatCompletionRequest, {"messages": MESSAGES, "temperature": temperature})
    assert sampling_params(req, 16, 0, None, {}).temperature == used
    assert (
        sampling_params(
            parse(ChatCompletionRequest, {"messages": MESSAGES}), 16, 0, None, {"temperature": 1e-6}
        ).temperature
        == 0.0
    )
