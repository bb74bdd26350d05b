"""The official `openai` client against the running app: plain, streaming with usage, and errors it raises."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from demo.inputs import data_url, make_image

pytestmark = pytest.mark.e2e


@pytest.fixture
def oai(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _image_message(text="What is in the picture?"):
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(make_image(100, 70))}},
                {"type": "text", "text": text},
            ],
        }
    ]


def test_models_and_non_streaming(oai):
    [model] = oai.models.list().data
    out = oai.chat.completions.create(model=model.id, messages=_image_message(), max_tokens=8, temperature=0)
    assert out.model == model.id and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content
    assert out.choices[0].finish_reason in ("stop", "length")
    assert (
        out.usage.completion_tokens <= 8
        and out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    )


def test_streaming_with_usage(oai):
    stream = oai.chat.completions.create(
        model="qwen2-vl-tiny",
        messages=_image_message(),
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and usage.completion_tokens <= 8
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = oai.chat.completions.create(model="qwen2-vl-tiny", messages=_image_message(), max_tokens=8, temperature=0)
    assert text == plain.choices[0].message.content
    assert usage.prompt_tokens == plain.usage.prompt_tokens


def test_errors_are_raised_by_the_client(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model="qwen2-vl-tiny",
            max_tokens=4,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ftp://example.com/cat.png"}}]}
            ],
        )
    assert e.value.status_code == 400
    assert e.value.body["param"] == "messages[0].content[0].image_url"
    assert "'ftp' is not accepted" in e.value.body["message"] and e.value.body["code"] == "image_url_not_allowed"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    # Streaming requests that fail before the first token get a real status too.
    with pytest.raises(openai.BadRequestError):
        list(
            oai.chat.completions.create(
                model="qwen2-vl-tiny", stream=True, max_tokens=5000, messages=[{"role": "user", "content": "hi"}]
            )
        )


def test_n_choices_and_logprobs(oai):
    out = oai.chat.completions.create(
        model="qwen2-vl-tiny",
        messages=_image_message(),
        max_tokens=6,
        n=3,
        temperature=1.0,
        seed=11,
        logprobs=True,
        top_logprobs=3,
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) > 1  # seeds differ per choice
    assert out.usage.completion_tokens == sum(len(c.logprobs.content) for c in out.choices)
    for c in out.choices:
        for tok in c.logprobs.content:
            assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
            assert tok.top_logprobs[0].logprob >= tok.top_logprobs[-1].logprob
    again = oai.chat.completions.create(
        model="qwen2-vl-tiny", messages=_image_message(), max_tokens=6, n=3, temperature=1.0, seed=11
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    stream = oai.chat.completions.create(
        model="qwen2-vl-tiny", messages=_image_message(), max_tokens=6, n=3, temperature=1.0, seed=11, stream=True
    )
    texts = ["", "", ""]
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert texts == [c.message.content for c in out.choices] and finished == {0, 1, 2}


def test_explicit_nulls_are_the_defaults(base_url):
    """The client sends None as JSON null; OpenAI and vLLM take it as the default, and so does the app."""
    sent: list[dict] = []
    hooks = {"request": [lambda request: sent.append(json.loads(request.content))]}
    with httpx.Client(event_hooks=hooks, timeout=60) as http:
        oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, http_client=http)
        nulls = dict.fromkeys(
            ["top_p", "n", "seed", "stop", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty"]
            + ["max_completion_tokens", "stream_options", "user", "stream"]
        )
        with_nulls = oai.chat.completions.create(
            model="qwen2-vl-tiny", messages=_image_message(), max_tokens=6, temperature=0, **nulls
        )
        plain = oai.chat.completions.create(
            model="qwen2-vl-tiny", messages=_image_message(), max_tokens=6, temperature=0
        )
        sampled = oai.chat.completions.create(
            model="qwen2-vl-tiny", messages=_image_message(), max_tokens=2, temperature=None
        )
    assert all(sent[0][k] is None for k in nulls) and sent[2]["temperature"] is None  # nulls on the wire
    assert with_nulls.choices[0].message.content == plain.choices[0].message.content
    assert len(with_nulls.choices) == 1 and with_nulls.choices[0].logprobs is None
    assert sampled.usage.completion_tokens <= 2


def test_models_retrieve_request_id_and_fingerprint(oai):
    assert oai.models.retrieve("qwen2-vl-tiny").id == "qwen2-vl-tiny"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")
    raw = oai.chat.completions.with_raw_response.create(
        model="qwen2-vl-tiny", messages=_image_message(), max_tokens=4, temperature=0
    )
    out = raw.parse()
    # Serve's own request id (the one on its log lines) when the client sent none; one header, not two.
    assert raw.headers.get_list("x-request-id") == [raw.headers["x-request-id"]] != [out.id]
    assert out.system_fingerprint.startswith("fp_")
    chunks = list(
        oai.chat.completions.create(
            model="qwen2-vl-tiny", messages=_image_message(), max_tokens=4, temperature=0, stream=True
        )
    )
    assert {c.system_fingerprint for c in chunks} == {out.system_fingerprint}
    echoed = oai.chat.completions.with_raw_response.create(
        model="qwen2-vl-tiny", messages=_image_message(), max_tokens=1, extra_headers={"x-request-id": "trace-7"}
    )
    assert echoed.headers.get_list("x-request-id") == ["trace-7"]
