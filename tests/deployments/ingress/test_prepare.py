"""Request -> prompt at the ingress: the context-overflow policy drops whole turns (and their images), never part of
one, and says what did not fit."""

from __future__ import annotations

import pytest

from demo.inputs import data_url, make_image
from deployments.ingress.prepare import Preparer, cache_scope, embedding_key, scoped_key
from schemas import AppArgs, InvalidRequest
from schemas.completions import CompletionRequest
from schemas.openai import ChatCompletionRequest

CONTEXT = 160


@pytest.fixture(scope="module")
def prep(checkpoint) -> Preparer:
    return Preparer(AppArgs(model=str(checkpoint), llm={"max_model_len": CONTEXT}))


def _image(seed: int, width: int = 112) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(make_image(width, 56, seed=seed))}}


def _conversation(turns: int) -> list[dict]:
    """A system message, then `turns` user turns (each with an image and ~20 words) and assistant answers."""
    messages = [{"role": "system", "content": "You look at pictures."}]
    for t in range(turns):
        messages.append({"role": "user", "content": [_image(t), {"type": "text", "text": f"turn {t} " + "w " * 20}]})
        messages.append({"role": "assistant", "content": f"answer {t} " + "a " * 10})
    messages.append({"role": "user", "content": [_image(99), {"type": "text", "text": "and this one?"}]})
    return messages


def _keys(p) -> list[str]:
    return [item.key for item in p.items]


def _grids(p) -> list[tuple[int, int, int]]:
    return [item.grid_thw for item in p.items]


def _prepare(prep: Preparer, messages: list[dict], **fields):
    req = ChatCompletionRequest(messages=messages, **fields)
    prep.check(req)
    return prep.prepare(req, {})


def test_a_prompt_that_fits_is_left_whole(prep):
    p = _prepare(prep, _conversation(1), context_overflow="drop_oldest_turns", max_tokens=8)
    assert p.dropped_messages == 0 and len(p.images) == 2


def test_error_policy_states_the_numbers(prep):
    with pytest.raises(InvalidRequest) as e:
        _prepare(prep, _conversation(6), max_tokens=8)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert "prompt tokens + max_tokens 8 exceed the context length of 160" in e.value.message


def test_drop_oldest_turns_keeps_system_and_whole_newest_turns(prep):
    messages = _conversation(6)
    p = _prepare(prep, messages, context_overflow="drop_oldest_turns", max_tokens=8)
    assert p.dropped_messages > 0 and p.dropped_messages % 2 == 0  # whole user + assistant turns
    kept = messages[:1] + messages[1 + p.dropped_messages :]
    # The same prompt as a request that never had the dropped turns: nothing cut inside a turn or an image run.
    alone = _prepare(prep, kept, max_tokens=8)
    assert p.prompt == alone.prompt and _keys(p) == _keys(alone) and _grids(p) == _grids(alone)
    assert len(p.prompt) + 8 <= CONTEXT
    text = prep.tokenizer.decode(p.prompt)
    assert "You look at pictures." in text and "and this one?" in text
    # Minimal: keeping one more turn would not have fitted.
    one_more = messages[:1] + messages[1 + p.dropped_messages - 2 :]
    with pytest.raises(InvalidRequest):
        _prepare(prep, one_more, max_tokens=8)


def test_dropped_images_go_with_their_turns(prep):
    messages = _conversation(6)
    p = _prepare(prep, messages, context_overflow="drop_oldest_turns", max_tokens=8)
    kept_images = (len(messages) - 1 - p.dropped_messages) // 2 + 1
    assert len(p.images) == len(p.items) == kept_images
    image_token_id = prep.image_token_id
    expected = sum(t * h * w // 4 for t, h, w in _grids(p))
    assert sum(1 for t in p.prompt if t == image_token_id) == expected
    # the kept images' counts, sent to the LLM
    assert [item.num_tokens for item in p.items] == [t * h * w // 4 for t, h, w in _grids(p)]


def test_a_last_turn_over_the_context_is_still_an_error(prep):
    messages = [
        {"role": "user", "content": "old"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "word " * 300},
    ]
    with pytest.raises(InvalidRequest) as e:
        _prepare(prep, messages, context_overflow="drop_oldest_turns")
    assert "(after dropping the 2 oldest messages)" in e.value.message and "context length of 160" in e.value.message


def test_server_default_policy_applies_when_the_request_names_none(checkpoint):
    prep = Preparer(
        AppArgs(model=str(checkpoint), llm={"max_model_len": CONTEXT}, limits={"context_overflow": "drop_oldest_turns"})
    )
    assert _prepare(prep, _conversation(6), max_tokens=8).dropped_messages > 0
    with pytest.raises(InvalidRequest):  # the request's own choice wins
        _prepare(prep, _conversation(6), max_tokens=8, context_overflow="error")


def test_every_turn_of_a_conversation_has_its_first_turns_routing_key(prep):
    conversation = _conversation(1)  # system, user, assistant, user
    turns = [_prepare(prep, conversation[:n], max_tokens=8) for n in (2, 4)]
    assert turns[0].routing_key == turns[1].routing_key
    # The system message and the first user turn, images included, make the key; nothing later does.
    first = conversation[:2]
    other_text = [first[0], {"role": "user", "content": [first[1]["content"][0], {"type": "text", "text": "hi"}]}]
    other_image = [first[0], {"role": "user", "content": [_image(5), first[1]["content"][1]]}]
    other_system = [{"role": "system", "content": "You read."}, first[1]]
    keys = {_prepare(prep, m, max_tokens=8).routing_key for m in (other_text, other_image, other_system)}
    assert len(keys) == 3 and turns[0].routing_key not in keys


def test_without_max_tokens_a_request_gets_the_room_left_in_the_context(checkpoint):
    """As vLLM: no max_tokens (or null) is max_model_len - prompt tokens; limits.default_max_tokens caps it when set."""
    context, messages = 2048, [{"role": "user", "content": "describe " * 10}]

    def prep(**limits) -> Preparer:
        return Preparer(AppArgs(model=str(checkpoint), llm={"max_model_len": context}, limits=limits))

    default = prep()
    for fields in ({}, {"max_tokens": None, "max_completion_tokens": None}):
        p = _prepare(default, messages, **fields)
        assert p.max_tokens == context - len(p.prompt) and p.max_tokens > 1024
    for cap, expected in ((8, 8), (context, context - len(p.prompt))):
        capped = prep(default_max_tokens=cap)
        assert _prepare(capped, messages).max_tokens == expected
        assert _prepare(capped, messages, max_tokens=20).max_tokens == 20  # the request's own wins over the cap


def test_a_conversation_that_opens_with_the_assistant_keeps_that_message(prep):
    """A greeting before the first user message is part of the first turn: nothing is dropped while it fits."""
    messages = [
        {"role": "system", "content": "You look at pictures."},
        {"role": "assistant", "content": "Hello! Send me a picture."},
        {"role": "user", "content": "hi"},
    ]
    for overflow in ("error", "drop_oldest_turns"):
        p = _prepare(prep, messages, max_tokens=8, context_overflow=overflow)
        assert p.dropped_messages == 0 and "Send me a picture." in prep.tokenizer.decode(p.prompt)


def test_each_kept_image_has_its_cost_from_its_header(prep):
    """The cost the encoder tier routes and scales on, known before any pixel work: a bigger image costs more, and
    an image dropped with its turn takes its cost with it."""
    small, big = _image(1, width=56), _image(2, width=224)
    p = _prepare(prep, [{"role": "user", "content": [small, big, {"type": "text", "text": "which?"}]}], max_tokens=4)
    costs = [item.cost for item in p.items]
    assert costs == [prep.image_cost.gflop(g) for g in _grids(p)] and 0 < costs[0] < costs[1]
    dropped = _prepare(prep, _conversation(6), context_overflow="drop_oldest_turns", max_tokens=8)
    assert [job.cost for item in dropped.items for job in item.jobs] == [
        prep.image_cost.gflop(g) for g in _grids(dropped)
    ]


def test_an_image_key_has_its_size_mode_preprocessing_and_model_not_only_its_bytes():
    sha = "0" * 64  # the same bytes
    keys = {
        embedding_key(sha, 30, 100, "RGB", "p", "m"),
        embedding_key(sha, 100, 30, "RGB", "p", "m"),
        embedding_key(sha, 30, 100, "L", "p", "m"),
        embedding_key(sha, 30, 100, "RGB", "p2", "m"),
        embedding_key(sha, 30, 100, "RGB", "p", "m2"),
    }
    assert len(keys) == 5


def test_two_scopes_never_share_a_key_and_one_keeps_its_own():
    """Two tenants (or two cache_salts): two scopes, two keys for the same image; the same one again: the same key.
    No scope: the shared key."""
    scopes = [cache_scope(None, None), cache_scope("tenant-a", None), cache_scope("tenant-b", None)]
    scopes += [cache_scope(None, "salt"), cache_scope("tenant-a", "salt"), cache_scope("tenant-a", "other")]
    assert scopes[0] == "" and len(set(scopes)) == len(scopes)
    assert cache_scope("tenant-a", "salt") == cache_scope("tenant-a", "salt")
    key = embedding_key("0" * 64, 30, 100, "RGB", "p", "m")
    assert len({scoped_key(key, scope) for scope in scopes}) == len(scopes) and scoped_key(key, "") == key


def test_the_cache_scope_is_in_every_image_key(prep):
    messages = [{"role": "user", "content": [_image(3), {"type": "text", "text": "what?"}]}]
    shared, a, a2, b = (
        prep.prepare(ChatCompletionRequest(messages=messages, max_tokens=4), {}, scope) for scope in ("", "a", "a", "b")
    )
    assert len({_keys(shared)[0], _keys(a)[0], _keys(b)[0]}) == 3 and _keys(a) == _keys(a2)
    assert [job.key for job in a.items[0].jobs] == _keys(a)  # one job, the image: the same key
    assert (shared.cache_scope, a.cache_scope) == ("", "a") and a.prompt == b.prompt


def test_the_cheap_checks_refuse_a_schema_too_costly_to_compile(prep):
    """Chat (`check`) and text completions (`check_generation`) both, before any image is read: at the default
    limit of 256 optional properties, 2,000 would have cost the LLM replica ~18 s of a core to compile."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    with pytest.raises(InvalidRequest, match="2000 properties that are not required, over the limit of 256"):
        prep.check(ChatCompletionRequest(messages=_conversation(1), response_format=fmt))
    with pytest.raises(InvalidRequest, match="over the limit of 256"):
        prep.check_generation(CompletionRequest(prompt="hi", response_format=fmt))
