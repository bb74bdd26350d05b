"""OpenAI request schema: strict on types and on fields we do not honour, with the field named."""

from __future__ import annotations

import pytest

from deployments.ingress.http import parse
from schemas import InvalidRequest
from schemas.completions import CompletionRequest
from schemas.openai import ChatCompletionRequest, ImagePart
from schemas.requests import NO_EFFECT


def test_no_effect_fields_tolerated_and_both_max_tokens_names():
    req = parse(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "user": "u1",
            "metadata": {"a": "b"},
            "store": False,
            "max_tokens": 5,
        },
    )
    assert req.requested_max_tokens == 5 and req.stop == []
    req = parse(
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7, "max_tokens": 5, "stop": "END"},
    )
    assert req.requested_max_tokens == 7 and req.stop == ["END"]


def test_image_parts():
    req = parse(
        ChatCompletionRequest,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "high"}},
                    ],
                }
            ]
        },
    )
    assert isinstance(req.messages[0].content[1], ImagePart)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 3}}]}]},
            "messages[0].content[0].image_url.url",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "audio", "x": 1}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}, "presence_penalty"),
        ({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": -2.5}, "frequency_penalty"),
        ({"messages": [{"role": "user", "content": "x"}], "top_k": -2}, "top_k"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "stop_token_ids": ["a"]}, "stop_token_ids[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
            "messages[0]",
        ),
    ],
)
def test_bad_fields_name_the_param(body, param):
    with pytest.raises(InvalidRequest) as e:
        parse(ChatCompletionRequest, body)
    assert e.value.param == param and e.value.status == 400
    assert e.value.message.startswith(param)


def test_top_logprobs_needs_logprobs():
    with pytest.raises(InvalidRequest, match="top_logprobs needs logprobs"):
        parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3})


def test_body_must_be_an_object():
    with pytest.raises(InvalidRequest, match="JSON object"):
        parse(ChatCompletionRequest, [1, 2])


# Every optional field the openai client can send as None (it sends None through as JSON null).
NULLABLE = [
    "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
    "stop", "n", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "top_k", "stop_token_ids",
    "return_token_ids", "ignore_eos", "context_overflow", "user", "metadata", "store", "response_format",
    "repetition_penalty", "min_p", "min_tokens", "logit_bias", "include_stop_str_in_output", "skip_special_tokens",
]  # fmt: skip


def test_an_explicit_null_is_the_default():
    """OpenAI and vLLM take null as "the default": the same request as one that leaves the field out."""
    hi = [{"role": "user", "content": "hi"}]
    default = parse(ChatCompletionRequest, {"messages": hi})
    nulls = parse(ChatCompletionRequest, {"messages": hi, **dict.fromkeys(NULLABLE)})
    assert nulls == default
    # temperature, top_p, top_k, min_p, repetition_penalty: None is the checkpoint's generation_config.json value
    # where it has one, else the API's (deployments/ingress/prepare.py's sampling_params)
    assert (nulls.temperature, nulls.top_p, nulls.n, nulls.stop, nulls.logprobs, nulls.stream) == (
        None, None, 1, [], False, False,
    )  # fmt: skip
    assert (nulls.logit_bias, nulls.min_tokens, nulls.skip_special_tokens, nulls.include_stop_str_in_output) == (
        {}, 0, True, False,
    )  # fmt: skip
    inner = parse(
        ChatCompletionRequest,
        {
            "messages": [
                {"role": "system", "content": "be brief", "name": None},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,", "detail": None}}]},
                {"role": "assistant", "content": None},
            ],
            "stream_options": {"include_usage": None},
        },
    )
    assert inner.messages[1].content[0].image_url.detail == "auto" and inner.stream_options.include_usage is False


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": None}, "messages"),
        ({"messages": [{"role": None, "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, "messages[0].content[0].text"),
    ],
)
def test_a_null_where_a_value_is_required_is_still_a_400(body, param):
    with pytest.raises(InvalidRequest) as e:
        parse(ChatCompletionRequest, body)
    assert e.value.param == param and e.value.status == 400


HI = [{"role": "user", "content": "hi"}]
# OpenAI's and vLLM's chat fields that this server does not honour: each must be refused by name, not ignored.
UNHONOURED = [
    "functions", "function_call", "audio", "modalities", "prediction", "reasoning_effort", "verbosity",
    "web_search_options", "best_of", "use_beam_search", "echo", "suffix", "prompt_logprobs", "chat_template",
    "chat_template_kwargs", "add_generation_prompt", "allowed_token_ids", "bad_words", "length_penalty", "priority",
    "truncate_prompt_tokens", "guided_decoding_backend", "no_such_field",
]  # fmt: skip


@pytest.mark.parametrize("field", UNHONOURED)
def test_a_field_we_do_not_honour_is_a_400_naming_it(field):
    with pytest.raises(InvalidRequest) as e:
        parse(ChatCompletionRequest, {"messages": HI, field: 1})
    assert (e.value.status, e.value.code, e.value.param) == (400, "unsupported_parameter", field)
    assert e.value.message.startswith(f"{field}: unsupported parameter")


def test_fields_without_effect_and_the_engines_sampling_fields_are_accepted():
    """The no-effect fields (user, metadata, store, ...) and the sampling fields the engine honours pass; a null
    for an unhonoured field is its absence."""
    assert {"user", "metadata", "store", "service_tier"} <= NO_EFFECT
    sampling = {"repetition_penalty": 1.1, "min_p": 0.1, "min_tokens": 1, "logit_bias": {"5": 1}}
    sampling |= {"include_stop_str_in_output": True, "skip_special_tokens": False}
    parse(ChatCompletionRequest, {"messages": HI, **dict.fromkeys(NO_EFFECT, 1), **sampling})
    parse(ChatCompletionRequest, {"messages": HI, "functions": None, "guided_json": {"type": "object"}})


@pytest.mark.parametrize("salt", ["", 5, "s" * 257, ["a"]])
def test_a_bad_cache_salt_is_a_400(salt):
    with pytest.raises(InvalidRequest) as e:
        parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "cache_salt": salt})
    assert (e.value.param, e.value.status) == ("cache_salt", 400)
    assert parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "cache_salt": "s"}).cache_salt


def test_mm_processor_kwargs_is_honoured_in_chat_and_refused_in_text_completions():
    """Video sampling (vLLM's mm_processor_kwargs) goes with chat's videos; a text completion takes no media."""
    req = parse(ChatCompletionRequest, {"messages": HI, "mm_processor_kwargs": {"fps": 1.0, "max_pixels": 3136}})
    assert req.mm_processor_kwargs.fps == 1.0
    with pytest.raises(InvalidRequest) as e:
        parse(CompletionRequest, {"prompt": "hi", "mm_processor_kwargs": {"fps": 1.0}})
    assert (e.value.code, e.value.param) == ("unsupported_parameter", "mm_processor_kwargs")
