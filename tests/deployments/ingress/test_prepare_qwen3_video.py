"""Qwen3-VL's videos at the ingress: each tubelet's timestamp and its run in vision markers, in the place of the
template's one video placeholder; one record for the engine (tubelet_runs); the Qwen2-VL videos' chunks and limits."""

from __future__ import annotations

import pytest

from demo.inputs import make_video, video_url
from demo.tiny_qwen3_vl import build_qwen3_vl_checkpoint
from deployments.ingress.prepare import Preparer
from schemas import AppArgs, InvalidRequest
from schemas.openai import ChatCompletionRequest

VIDEO = make_video(3, fps=8, width=160, height=120, seed=7)  # 24 frames: 6 sampled, 3 tubelets of 6x8 patches


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_qwen3_vl_checkpoint(tmp_path_factory.mktemp("q3v-ingress") / "qwen3-vl-tiny")


def _prepare(prep: Preparer, **fields):
    content = [{"type": "video_url", "video_url": {"url": video_url(VIDEO)}}, {"type": "text", "text": "What?"}]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": content}], **fields)
    prep.check(req)
    return prep.prepare(req, {})


def test_each_tubelet_is_its_timestamp_and_its_run(ckpt):
    prep = Preparer(AppArgs(model=str(ckpt), llm={"max_model_len": 512}))
    p = _prepare(prep, max_tokens=8)
    (item,) = p.items
    assert item.is_video and item.tubelet_runs and item.grid_thw == (3, 6, 8)
    assert item.num_tokens == 36 == p.prompt.count(prep.video_token_id)
    run = "<|vision_start|>" + "<|video_pad|>" * 12 + "<|vision_end|>"
    expected = f"<|vision_start|><0.3 seconds>{run}<1.4 seconds>{run}<2.6 seconds>{run}<|vision_end|>What?"
    assert expected in prep.tokenizer.decode(p.prompt)
    assert (
        prep.tokenizer.decode(item.prompt_ids)
        == expected.removeprefix("<|vision_start|>").split("<|vision_end|>What")[0]
    )


def test_a_video_over_the_batch_budget_goes_in_chunks_of_tubelets(ckpt):
    prep = Preparer(AppArgs(model=str(ckpt), llm={"max_model_len": 512}, encoder={"max_batch_patches": 96}))
    (item,) = _prepare(prep, max_tokens=8).items
    assert [(job.num_tokens, job.patches) for job in item.jobs] == [(24, 96), (12, 48)]
    assert [job.data.plan.timestamps for job in item.jobs] == [
        item.data.plan.timestamps[:2],
        item.data.plan.timestamps[2:],
    ]


def test_the_video_limits_hold(ckpt):
    prep = Preparer(AppArgs(model=str(ckpt), llm={"max_model_len": 512}, video={"max_video_tokens": 30}))
    with pytest.raises(InvalidRequest, match="video takes 36 tokens, over the limit of 30") as e:
        _prepare(prep, max_tokens=8)
    assert e.value.param == "messages[0].content[0]"
    fewer = _prepare(prep, max_tokens=8, mm_processor_kwargs={"fps": 1.0})  # 4 frames: 2 tubelets, 24 tokens
    assert fewer.items[0].grid_thw[0] == 2 and fewer.prompt.count(prep.video_token_id) == 24
