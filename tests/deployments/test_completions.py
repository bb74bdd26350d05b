"""POST /v1/completions, /tokenize and /detokenize through the deployed app with the `openai` client (the session's
app: the tiny Qwen2-VL, max_model_len 1024, limits.default_max_tokens 16), echo with the prompt's logprobs against
transformers', and fields we do not honour as 400s."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from demo.inputs import data_url, make_image

pytestmark = pytest.mark.e2e
MODEL = "qwen2-vl-tiny"
PROMPT = "Tell me about red circles."
TEXT_CHAT = [{"role": "user", "content": PROMPT}]


@pytest.fixture
def oai(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_completion_streamed_and_not(oai):
    out = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    [choice] = out.choices
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.system_fingerprint.startswith("fp_")
    assert choice.text and choice.finish_reason in ("stop", "length") and choice.logprobs is None
    assert 0 < out.usage.completion_tokens <= 8 and out.usage.prompt_tokens > 0
    chunks = list(
        oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage == out.usage
    assert "".join(c.choices[0].text for c in chunks[:-1]) == choice.text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == choice.finish_reason


def test_a_completion_takes_the_same_engine_path_as_chat(oai, base_url):
    """The chat template's prompt ids (from /tokenize) sent as a completion's prompt give the chat's answer."""
    chat = oai.chat.completions.create(model=MODEL, messages=TEXT_CHAT, max_tokens=12, temperature=0)
    ids = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "messages": TEXT_CHAT}).json()["tokens"]
    out = oai.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert out.choices[0].text == chat.choices[0].message.content
    assert out.usage == chat.usage.model_copy(update={"prompt_tokens_details": out.usage.prompt_tokens_details})


def test_without_max_tokens_a_completion_gets_the_room_left(oai):
    """As chat: the room left in the context (max_model_len 1024), capped by limits.default_max_tokens (16)."""
    capped = oai.completions.create(model=MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert (capped.usage.completion_tokens, capped.choices[0].finish_reason) == (16, "length")
    room = oai.completions.create(model=MODEL, prompt=[7] * 1020, temperature=0, extra_body={"ignore_eos": True})
    assert (room.usage.prompt_tokens, room.usage.completion_tokens) == (1020, 4)


def test_prompt_lists_and_n_number_their_choices_as_vllm(oai):
    """Choice i is prompt i // n's choice i % n; each is the answer its prompt gets alone (seed + i)."""
    prompts = [PROMPT, "What shape is the moon?"]
    out = oai.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=1.0, seed=3)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for k, prompt in enumerate(prompts):
        alone = oai.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=6, temperature=1.0, seed=3)
        assert [c.text for c in out.choices[2 * k : 2 * k + 2]] == [c.text for c in alone.choices]
    ids = oai.completions.create(model=MODEL, prompt=[[7, 8, 9], [10, 11]], max_tokens=2, temperature=0)
    assert ids.usage.prompt_tokens == 5 and len(ids.choices) == 2


def test_stop_cuts_the_text_before_the_first_match(oai):
    free = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_logprobs_in_the_legacy_format(oai):
    out = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 4 and top[token] == logprob == max(top.values())  # greedy: the sampled is the top
    sampled = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5, logprobs=0)
    lp0 = sampled.choices[0].logprobs  # k = 0: the sampled token alone, whatever its rank
    assert lp0.top_logprobs == [{t: v} for t, v in zip(lp0.tokens, lp0.token_logprobs, strict=True)]
    streamed = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, stream=True)
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_echo_prepends_the_prompt(oai):
    out = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    plain = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].text == PROMPT + plain.choices[0].text
    streamed = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_echo_with_logprobs_gives_the_prompts_logprobs(oai, base_url, reference):
    """The echoed prompt's tokens come first in `logprobs`, the first with null (nothing precedes it), the others
    with transformers' log-softmax over the prompt; then the completion's, as without echo. The same again once
    the prompt is in the prefix cache, streamed, and for n choices."""
    ids = httpx.post(f"{base_url}/tokenize", json={"prompt": PROMPT}, timeout=60).json()["tokens"]
    with torch.no_grad():
        ref = torch.log_softmax(reference(input_ids=torch.tensor([ids])).logits[0].float(), -1)  # (P, V)
    ask = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    plain = oai.completions.create(**ask).choices[0].logprobs
    out = oai.completions.create(**ask, echo=True)
    lp = out.choices[0].logprobs
    p = len(ids)
    assert "".join(lp.tokens[:p]) == PROMPT and out.choices[0].text == PROMPT + "".join(plain.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, p):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=2e-4), i
        assert len(lp.top_logprobs[i]) in (2, 3) and max(lp.top_logprobs[i].values()) == pytest.approx(
            float(ref[i - 1].max()), abs=2e-4
        )
    assert lp.tokens[p:] == plain.tokens and lp.token_logprobs[p:] == pytest.approx(plain.token_logprobs, abs=1e-5)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    again = oai.completions.create(**ask, echo=True).choices[0].logprobs  # the prompt's blocks are cached now
    assert again.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    streamed = [c.choices[0].logprobs for c in oai.completions.create(**ask, echo=True, stream=True)]
    assert [t for s in streamed if s for t in s.tokens] == lp.tokens
    assert [v for s in streamed if s for v in s.token_logprobs][1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    two = oai.completions.create(**{**ask, "temperature": 1.0, "seed": 3}, n=2, echo=True)
    for choice in two.choices:  # the prompt's first choice computed them; both carry them
        assert choice.logprobs.token_logprobs[1:p] == pytest.approx(lp.token_logprobs[1:p], abs=1e-5)


@pytest.mark.parametrize(
    ("create", "param"),
    [
        (lambda oai: oai.completions.create(model=MODEL, prompt=PROMPT, suffix="!"), "suffix"),
        (lambda oai: oai.completions.create(model=MODEL, prompt=PROMPT, best_of=2), "best_of"),
        (lambda oai: oai.chat.completions.create(model=MODEL, messages=TEXT_CHAT, reasoning_effort="low"), None),
        (lambda oai: oai.chat.completions.create(model=MODEL, messages=TEXT_CHAT, modalities=["audio"]), None),
    ],
)
def test_a_field_we_do_not_honour_is_a_400_naming_it(oai, create, param):
    with pytest.raises(openai.BadRequestError) as e:
        create(oai)
    body = e.value.body
    assert body["code"] == "unsupported_parameter" and body["type"] == "invalid_request_error"
    assert body["param"] == (param or body["message"].split(":")[0]) and body["param"] in body["message"]


def test_prompts_that_are_not_the_models_are_400s(oai):
    for prompt, fragment in [
        ("a <|image_pad|> typed", "reserved token"),
        ([1, 10**9], "not in the vocabulary"),
        ([[1], []], "must not be empty"),
        ([7] * 1024, "exceed the context length of 1024"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        assert fragment in e.value.body["message"] and e.value.body["param"].startswith("prompt"), e.value.body


def test_tokenize_then_detokenize_round_trips_the_chat_prompt(oai, base_url):
    """/tokenize's ids for a conversation with an image are the ids the chat completion generated from; /detokenize
    gives their text, and that text tokenizes back to them."""
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(make_image(100, 70))}},
                {"type": "text", "text": "What is in the picture?"},
            ],
        }
    ]
    chat = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body={"return_token_ids": True}
    )
    prompt_ids = chat.model_extra["prompt_token_ids"]
    with httpx.Client(base_url=base_url, timeout=60) as http:
        tokenized = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
        assert tokenized == {"count": len(prompt_ids), "max_model_len": 1024, "tokens": prompt_ids}
        text = http.post("/detokenize", json={"model": MODEL, "tokens": prompt_ids}).json()["prompt"]
        assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
        again = http.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}).json()
        assert again["tokens"] == prompt_ids
        bare = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
        assert bare["tokens"] == prompt_ids[: bare["count"]] and bare["count"] < len(prompt_ids)
        for path, body, param in [
            ("/tokenize", {"prompt": "x", "messages": messages}, None),
            ("/tokenize", {"prompt": "x", "chat_template": "{{ 1 }}"}, "chat_template"),
            ("/detokenize", {"tokens": [-1]}, "tokens"),
            ("/detokenize", {"tokens": [1], "model": "gpt-4o"}, "model"),
        ]:
            r = http.post(path, json=body)
            assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("typed", ["<|image_pad|>", "<|vision_start|>"])
def test_an_image_token_typed_as_text_is_a_400_on_every_route(base_url, typed):
    """A user's literal image placeholder (or marker) with no image is a 400 naming the reserved token, before any
    engine work, on chat and text completions, streamed or not, and /tokenize's chat form: never the LLM replica's
    placeholder count error (a 500). vLLM is going the same way (vllm-project/vllm#57740, #57781: a validation error
    where such a token binds an image wrongly). /tokenize's prompt form only tokenizes, as vLLM's does."""
    text = f"what is {typed} here?"
    [token_id] = httpx.post(f"{base_url}/tokenize", json={"prompt": typed, "add_special_tokens": False}).json()[
        "tokens"
    ]
    chat, parts = [{"role": "user", "content": text}], [{"role": "user", "content": [{"type": "text", "text": text}]}]
    calls = [
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 2}, "messages"),
        ("/v1/chat/completions", {"messages": parts, "max_tokens": 2, "stream": True}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": text}, *TEXT_CHAT]}, "messages"),
        ("/v1/completions", {"prompt": text, "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": text, "max_tokens": 2, "stream": True}, "prompt"),
        ("/v1/completions", {"prompt": [1, 2, token_id], "max_tokens": 2}, "prompt"),
        ("/tokenize", {"messages": chat}, "messages"),
    ]
    for path, body, param in calls:
        r = httpx.post(f"{base_url}{path}", json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 400, (path, body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and typed in error["message"] and "reserved token" in error["message"], error
    assert token_id in httpx.post(f"{base_url}/tokenize", json={"prompt": text}).json()["tokens"]
    ok = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text
