"""Videos at the ingress: input forms, mm_processor_kwargs, placeholders in the prompt, cache keys, limits, and the
context-overflow policy, all before any decoding (the plan counts the tokens)."""

from __future__ import annotations

import base64

import pytest
from pydantic import ValidationError

from demo.inputs import data_url, image_bytes, make_image, make_video, video_url
from deployments.ingress.prepare import Preparer
from deployments.ingress.videos import VideoPreparer
from encoders.video_decode import Video
from schemas import AppArgs, InvalidRequest
from schemas.completions import CompletionRequest
from schemas.openai import ChatCompletionRequest

SMALL = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 8}  # a 64x48 frame: 56x56, 4 tokens a tubelet
VIDEO = make_video(2.5, fps=8, width=64, height=48)  # 20 frames: 4 sampled at 2 fps, 2 tubelets, 8 tokens


@pytest.fixture(scope="module")
def prep(checkpoint) -> Preparer:
    return Preparer(AppArgs(model=str(checkpoint), llm={"max_model_len": 160}))


def _video_part(data: bytes = VIDEO) -> dict:
    return {"type": "video_url", "video_url": {"url": video_url(data)}}


def _keys(p) -> list[str]:
    return [item.key for item in p.items]


def _grids(p) -> list[tuple[int, int, int]]:
    return [item.grid_thw for item in p.items]


def _timing(p) -> list[float | None]:
    return [item.second_per_grid_t for item in p.items]


def _prepare(prep: Preparer, content: list, fetched: dict | None = None, **fields):
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": content}], mm_processor_kwargs=fields.pop("kw", SMALL), **fields
    )
    prep.check(req)
    return prep.prepare(req, fetched or {})


def test_one_video_is_one_placeholder_run_counted_before_decoding(prep):
    p = _prepare(prep, [_video_part(), {"type": "text", "text": "What happens?"}], max_tokens=8)
    video_pad = prep.video_token_id
    assert p.prompt.count(video_pad) == 8 and _grids(p) == [(2, 4, 4)] and [i.is_video for i in p.items] == [True]
    start = p.prompt.index(video_pad)
    assert p.prompt[start - 1] == prep.tokens.per_image_ids[0] and p.prompt[start + 8] == prep.tokens.per_image_ids[1]
    (video,) = [item.data for item in p.items]
    assert isinstance(video, Video) and video.plan.indices == (0, 6, 13, 19) and video.plan.sample_fps == 1.6
    assert _timing(p) == [2 / 1.6] and _keys(p)[0].startswith("video:")
    assert p.images == []  # grounding boxes are for images only


def test_a_video_then_an_image_keep_their_order(prep):
    image = {"type": "image_url", "image_url": {"url": data_url(make_image(56, 56))}}
    p = _prepare(prep, [_video_part(), image, {"type": "text", "text": "Both?"}], max_tokens=8)
    kinds = [t for t in p.prompt if t in (prep.video_token_id, prep.image_token_id)]
    assert kinds == [prep.video_token_id] * 8 + [prep.image_token_id] * 4
    assert _timing(p) == [1.25, None] and [(im.number, im.size) for im in p.images] == [(0, (56, 56))]


def test_the_other_input_forms_are_the_same_video(prep):
    frames = [image_bytes(make_image(64, 48, seed=s), "JPEG") for s in range(4)]
    as_list = "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)
    vllm = _prepare(prep, [{"type": "video_url", "video_url": {"url": as_list}}, {"text": "x"}])
    qwen = _prepare(prep, [{"video": [data_url(f, "JPEG") for f in frames]}, {"text": "x"}])
    assert vllm.prompt == qwen.prompt and _keys(vllm) == _keys(qwen) and _grids(vllm) == [(2, 4, 4)]
    assert qwen.items[0].data.plan.indices == (0, 1, 2, 3) and qwen.items[0].data.plan.sample_fps == 2.0
    mindie = _prepare(prep, [{"video": video_url(VIDEO)}, {"text": "x"}])
    openai = _prepare(prep, [_video_part(), {"type": "text", "text": "x"}])
    assert mindie.prompt == openai.prompt and _keys(mindie) == _keys(openai)
    fetched = _prepare(prep, [{"video": "file:///v.mp4"}, {"text": "x"}], {"messages[0].content[0].video_url": VIDEO})
    assert _keys(fetched) == _keys(openai)


def test_sampling_settings_change_the_key_and_the_tokens(prep):
    two = _prepare(prep, [_video_part()], kw=SMALL)
    one = _prepare(prep, [_video_part(make_video(8, fps=8, width=64, height=48))], kw={**SMALL, "fps": 1})
    four = _prepare(prep, [_video_part(make_video(8, fps=8, width=64, height=48))], kw={**SMALL, "nframes": 16})
    assert _grids(one) == [(4, 4, 4)] and _grids(four) == [(8, 4, 4)] and _grids(two) == [(2, 4, 4)]
    assert _timing(one) == [2.0] and _timing(four) == [1.0]  # 16 frames in 8 s
    assert len({_keys(one)[0], _keys(four)[0]}) == 2
    with pytest.raises(ValidationError, match="give fps or nframes, not both"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], mm_processor_kwargs={"fps": 1, "nframes": 4})


def test_limits_name_the_number_and_the_limit(checkpoint):
    def prep_with(**video) -> Preparer:
        return Preparer(AppArgs(model=str(checkpoint), llm={"max_model_len": 160}, video=video))

    with pytest.raises(InvalidRequest, match=r"2 videos in one request, over the limit of 1") as e:
        _prepare(prep_with(), [_video_part(), _video_part()])
    assert e.value.param == "messages[0].content[1]"
    with pytest.raises(InvalidRequest, match=r"content\[0\]: video takes 8 tokens, over the limit of 7") as e:
        _prepare(prep_with(max_video_tokens=7), [_video_part()])
    assert e.value.status == 400
    with pytest.raises(InvalidRequest, match="video sampling gives 16 frames, over the limit of 8"):
        _prepare(prep_with(max_frames=8), [_video_part(make_video(8, fps=8))], kw={**SMALL, "nframes": 16})
    with pytest.raises(InvalidRequest, match="video is .* bytes, over the limit of 1000") as e:
        _prepare(prep_with(max_video_bytes=1000), [_video_part()])
    assert e.value.status == 413


def test_typed_video_placeholders_are_refused(prep):
    with pytest.raises(InvalidRequest, match=r"1 '<\|video_pad\|>' tokens for 0 images"):
        _prepare(prep, [{"type": "text", "text": "<|video_pad|>"}])
    with pytest.raises(InvalidRequest, match=r"2 '<\|video_pad\|>' tokens for 0 images and 1 videos"):
        _prepare(prep, [_video_part(), {"type": "text", "text": "<|video_pad|>"}])


def test_a_model_without_video_says_so():
    preparer = VideoPreparer(AppArgs.model_construct(video=AppArgs.model_fields["video"].default_factory()), None,
                             "m", "llava-tiny")  # fmt: skip
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [{"text": "x"}, {"video": "data:,"}]}])
    with pytest.raises(InvalidRequest, match="model 'llava-tiny' does not take video input") as e:
        preparer.check(req)
    assert e.value.param == "messages[0].content[1]"


def test_context_overflow_drops_whole_videos(prep):
    def turn(t: int) -> list[dict]:
        return [{"role": "user", "content": [_video_part(), {"type": "text", "text": f"turn {t} " + "w " * 20}]},
                {"role": "assistant", "content": "ok " * 10}]  # fmt: skip

    messages = turn(0) + turn(1) + turn(2) + [{"role": "user", "content": [_video_part(), {"text": "now?"}]}]
    req = ChatCompletionRequest(
        messages=messages, mm_processor_kwargs=SMALL, context_overflow="drop_oldest_turns", max_tokens=8
    )  # fmt: skip
    big = Preparer(AppArgs(model=str(prep.args.model), llm={"max_model_len": 160}, video={"max_videos_per_request": 4}))
    big.check(req)
    p = big.prepare(req, {})
    assert p.dropped_messages > 0 and all(i.is_video for i in p.items) and len(p.items) == 4 - p.dropped_messages // 2
    assert p.prompt.count(big.video_token_id) == 8 * len(p.items)  # whole runs only


def test_a_video_over_the_batch_budget_goes_in_chunks_of_tubelets(checkpoint):
    def jobs(**encoder):
        prep = Preparer(AppArgs(model=str(checkpoint), llm={"max_model_len": 160}, encoder=encoder))
        image = {"type": "image_url", "image_url": {"url": data_url(make_image(56, 56))}}
        return _prepare(prep, [image, _video_part(make_video(4, fps=8, width=64, height=48))], max_tokens=8)

    whole, split, colocated = jobs(), jobs(max_batch_patches=16), jobs(max_batch_patches=16, colocated=True)

    def per_item(p) -> list[int]:
        return [len(item.jobs) for item in p.items]

    assert _grids(whole)[1] == (4, 4, 4) and per_item(whole) == [1, 1]  # 4 tubelets of 16 patches
    assert per_item(split) == [1, 4] and _grids(split) == _grids(whole) and split.prompt == whole.prompt
    chunks = split.items[1].jobs
    assert [job.data.plan.indices for job in chunks] == [(0, 4), (9, 13), (18, 22), (27, 31)]
    assert [job.key for job in chunks] == [f"{whole.items[1].jobs[0].key}@{a}-{a + 1}" for a in range(4)]
    assert [(job.patches, job.num_tokens) for job in chunks] == [(16, 4)] * 4  # a tubelet each: 16 patches, 4 tokens
    assert sum(job.cost for job in chunks) == pytest.approx(whole.items[1].jobs[0].cost)
    assert _keys(split) == _keys(whole)  # the prefix cache keys the whole video
    assert per_item(colocated) == [1, 1]  # the LLM replica encodes it itself, whole


def test_tokenize_gives_a_video_chat_its_prompt_and_a_text_completion_takes_no_video(prep):
    """/tokenize's messages form expands videos as chat does (the video's sampling included); a text completion's
    prompt may not carry a video's placeholder (red with the video placeholder left out of the reserved tokens)."""
    content = [_video_part(), {"type": "text", "text": "What happens?"}]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": content}], mm_processor_kwargs=SMALL)
    prep.check(req)
    assert prep.tokenize_chat(req, {}, True) == _prepare(prep, content, max_tokens=8).prompt
    for text in ("a <|video_pad|> typed", "<|vision_start|>"):
        with pytest.raises(InvalidRequest, match="text must not contain that reserved token") as e:
            prep.prompts(CompletionRequest(prompt=text, max_tokens=4))
        assert e.value.param == "prompt"
