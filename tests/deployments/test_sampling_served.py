"""The sampling fields through the deployed app with the `openai` client, on the tiny random checkpoint: logit_bias
forces a token, min_tokens holds EOS back, include_stop_str_in_output keeps the stop, skip_special_tokens false
shows special tokens, and greedy with repetition_penalty equals transformers' generate with it."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from tests.deployments.parity import CASES, openai_messages, reference_generate

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Tell me about red circles."}]


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return AutoTokenizer.from_pretrained(checkpoint)


def _ask(oai, **fields):
    extra = {k: fields.pop(k) for k in list(fields) if k not in ("temperature", "seed", "n", "stop", "logit_bias")}
    return oai.chat.completions.create(
        model="qwen2-vl-tiny", messages=MESSAGES, max_tokens=fields.pop("max_tokens", 6), **fields,
        extra_body={"return_token_ids": True, **extra},
    )  # fmt: skip


def test_logit_bias_forces_a_token_in_every_choice(oai, tokenizer):
    [blue] = tokenizer.encode(" blue", add_special_tokens=False)
    free = _ask(oai, temperature=0)
    assert blue not in free.choices[0].token_ids  # not vacuous: the model does not say it by itself
    forced = _ask(oai, temperature=1.0, seed=3, n=2, logit_bias={str(blue): 100})
    for choice in forced.choices:
        assert choice.token_ids == [blue] * 6 and choice.message.content == " blue" * 6


def test_min_tokens_holds_eos_back(oai, tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    at_once = _ask(oai, temperature=0, logit_bias={str(eos): 100})
    assert at_once.choices[0].token_ids == [eos] and at_once.choices[0].finish_reason == "stop"
    assert at_once.choices[0].message.content == ""
    held = _ask(oai, temperature=0, logit_bias={str(eos): 100}, min_tokens=4, max_tokens=12)
    assert len(held.choices[0].token_ids) == 5 and held.choices[0].token_ids[-1] == eos
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 5


def test_include_stop_str_in_output_keeps_the_stop(oai):
    text = _ask(oai, temperature=0, max_tokens=16).choices[0].message.content
    stop = text[5:8]
    at = text.index(stop)
    cut = _ask(oai, temperature=0, max_tokens=16, stop=[stop]).choices[0]
    kept = _ask(oai, temperature=0, max_tokens=16, stop=[stop], include_stop_str_in_output=True).choices[0]
    assert cut.message.content == text[:at] and kept.message.content == text[: at + len(stop)]
    assert cut.finish_reason == kept.finish_reason == "stop"


def test_skip_special_tokens_false_shows_them(oai, tokenizer):
    box = tokenizer.convert_tokens_to_ids("<|box_start|>")
    skipped = _ask(oai, temperature=0, max_tokens=3, logit_bias={str(box): 100})
    shown = _ask(oai, temperature=0, max_tokens=3, logit_bias={str(box): 100}, skip_special_tokens=False)
    assert skipped.choices[0].token_ids == shown.choices[0].token_ids == [box] * 3
    assert skipped.choices[0].message.content == "" and shown.choices[0].message.content == "<|box_start|>" * 3


@pytest.mark.parametrize(("case", "penalty"), [("text_only", 1.5), ("one_image", 0.8)])
def test_greedy_with_repetition_penalty_equals_transformers(oai, checkpoint, reference, case, penalty):
    """Above 1 and below (a reward); with an image, whose placeholder tokens the penalty counts as transformers'."""
    conversation = CASES[case]
    prompt, ref = reference_generate(checkpoint, reference, conversation, 24, repetition_penalty=penalty)
    plain = reference_generate(checkpoint, reference, conversation, 24)[1]
    assert ref != plain  # the penalty changes the answer
    out = oai.chat.completions.create(
        model="qwen2-vl-tiny", messages=openai_messages(conversation), max_tokens=24, temperature=0,
        extra_body={"return_token_ids": True, "repetition_penalty": penalty},
    )  # fmt: skip
    assert out.prompt_token_ids == prompt and out.choices[0].token_ids == ref


def test_bad_sampling_fields_are_400s(oai):
    with pytest.raises(openai.BadRequestError) as e:
        _ask(oai, logit_bias={"9999999": 5})
    assert e.value.body["param"] == "logit_bias" and "outside the vocabulary" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        _ask(oai, min_tokens=7)  # max_tokens 6
    assert e.value.body["param"] == "min_tokens"
