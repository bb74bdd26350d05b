"""Video through the deployed app: greedy tokens equal transformers' generate on the same checkpoint, for Qwen2-VL,
Qwen2.5-VL and Qwen3-VL (through the encoder tier and colocated), with one video, and a video then an image; the
reference gets the same frames (tests/video_reference.py: qwen-vl-utils' or transformers' Qwen3-VL sampling, PyAV's
frames, transformers' preprocessing, and for Qwen3-VL the processor's timestamped prompt text)."""

from __future__ import annotations

import httpx
import pytest
import torch
from ray import serve
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)

from demo.inputs import data_url, make_image, make_video, video_url
from demo.tiny_qwen2_5_vl import build_qwen2_5_vl_checkpoint
from demo.tiny_qwen3_vl import build_qwen3_vl_checkpoint
from tests.deployments.parity import MAX_TOKENS, deployed
from tests.video_reference import reference_qwen3_video, reference_video

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("ray_serve")]  # (its `served` fixture asks for it by name)

KW = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16}  # 160x120 frames: 112x84, 12 tokens a tubelet
VIDEO = make_video(3, fps=8, width=160, height=120, seed=7)  # 24 frames: 6 sampled, 3 tubelets, 36 tokens
CASES = {  # a user message's parts, or a conversation of (role, parts)
    "one_video": [VIDEO, "What happens in the video?"],
    "video_then_image": [VIDEO, make_image(120, 80, seed=1), "Is the picture in the video?"],
    "two_turns": [("user", [VIDEO, "What happens?"]), ("assistant", ["A bar moves right."]), ("user", ["Why?"])],
}


def _turns(case: list) -> list[tuple[str, list]]:
    return case if isinstance(case[0], tuple) else [("user", case)]


def reference_generate(checkpoint, reference, case: list) -> tuple[list[int], list[int]]:
    """transformers: chat template, placeholder runs, mm_token_type_ids (image 1, video 2), generate (a case has at
    most one video and one image)."""
    tokenizer, processor = AutoTokenizer.from_pretrained(checkpoint), AutoImageProcessor.from_pretrained(checkpoint)
    cfg = reference.config
    messages, kwargs, counts = [], {}, []
    for role, parts in _turns(case):
        messages.append(
            {"role": role, "content": _reference_content(parts, processor, reference, kwargs, counts, checkpoint)}
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    runs = {cfg.image_token_id, cfg.video_token_id}
    if isinstance(reference, Qwen3VLForConditionalGeneration):  # the processor's way: the video's text replaced
        pieces = text.split("<|video_pad|>")
        texts = [c for c in counts if isinstance(c, str)]
        text = pieces[0] + "".join(texts.pop(0) + rest for rest in pieces[1:])
        counts, runs = [c for c in counts if isinstance(c, int)], {cfg.image_token_id}
    it = iter(counts)
    ids = [t for tok in tokenizer.encode(text) for t in ([tok] * next(it) if tok in runs else [tok])]
    input_ids = torch.tensor([ids])
    types = (input_ids == cfg.image_token_id).int() + 2 * (input_ids == cfg.video_token_id).int()
    with torch.no_grad():
        out = reference.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=types,
            do_sample=False, max_new_tokens=MAX_TOKENS, **kwargs,
        )  # fmt: skip
    return ids, out[0, len(ids) :].tolist()


def _reference_content(parts: list, processor, reference, kwargs: dict, counts: list, checkpoint) -> list[dict]:
    """One message's parts for the template; each video's and image's inputs into kwargs, their token counts (a
    Qwen3-VL video: its placeholder text)."""
    content = []
    for part in parts:
        if isinstance(part, str):
            content.append({"type": "text", "text": part})
        elif isinstance(part, bytes) and isinstance(reference, Qwen3VLForConditionalGeneration):
            content.append({"type": "video"})
            pixels, grid, text = reference_qwen3_video(part, checkpoint)
            kwargs |= {"pixel_values_videos": pixels, "video_grid_thw": torch.tensor([grid])}
            counts.append(text)
        elif isinstance(part, bytes):
            content.append({"type": "video"})
            pixels, grid, second_per_grid_t = reference_video(part, **KW)
            kwargs |= {"pixel_values_videos": pixels, "video_grid_thw": torch.tensor([grid])}
            if isinstance(reference, Qwen2_5_VLForConditionalGeneration):  # as the processor's BatchFeature: float32
                kwargs["second_per_grid_ts"] = torch.tensor([second_per_grid_t])
            counts.append(grid[0] * grid[1] * grid[2] // 4)
        else:
            content.append({"type": "image"})
            processed = processor(images=[part], return_tensors="pt")
            kwargs |= {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
            counts.append(int(processed["image_grid_thw"].prod()) // 4)
    return content


def served_generate(client: httpx.Client, case: list, kw: dict | None = KW) -> dict:
    messages = [
        {"role": role, "content": [
            {"type": "text", "text": p} if isinstance(p, str)
            else {"type": "video_url", "video_url": {"url": video_url(p)}} if isinstance(p, bytes)
            else {"type": "image_url", "image_url": {"url": data_url(p)}}
            for p in parts
        ]}
        for role, parts in _turns(case)
    ]  # fmt: skip
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    if kw is not None:
        body["mm_processor_kwargs"] = kw
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl colocated"])
def served(request, tmp_path_factory):
    if request.param == "qwen2_vl":  # the session's app and checkpoint (tests/conftest.py)
        with httpx.Client(base_url=request.getfixturevalue("base_url"), timeout=120) as client:
            yield client, request.getfixturevalue("checkpoint"), request.getfixturevalue("reference"), KW
        return
    if request.param.startswith("qwen3_vl"):
        # NOTE: seed 2, as the engine's Qwen3-VL tests: its DeepStack levels move the greedy tokens
        checkpoint = build_qwen3_vl_checkpoint(tmp_path_factory.mktemp("q3v") / "qwen3-vl-tiny", seed=2)
        reference = Qwen3VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
        colocated = request.param.endswith("colocated")
        # NOTE: 96 patches a batch, as Qwen2.5-VL's: the video's 3 tubelets of 48 patches go in two chunks
        encoder = {"colocated": True} if colocated else {"max_batch_patches": 96}
        args = {**request.getfixturevalue("app_args"), "encoder": encoder}
        name = "q3vc" if colocated else "q3v"
        with deployed(request.getfixturevalue("ray_serve"), args, checkpoint, name) as client:
            # Qwen3-VL's tiny checkpoint's own video budget gives 128x96 frames (demo/tiny_qwen3_vl.py): no kwargs
            yield client, checkpoint, reference, None
        return
    checkpoint = build_qwen2_5_vl_checkpoint(tmp_path_factory.mktemp("q25v") / "qwen2.5-vl-tiny", seed=1)
    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    # NOTE: 96 patches a batch: this app's videos (3 tubelets of 48 patches) go to the encoders in two chunks
    args = {**request.getfixturevalue("app_args"), "encoder": {"max_batch_patches": 96}}
    with deployed(request.getfixturevalue("ray_serve"), args, checkpoint, "qwen25v") as client:
        yield client, checkpoint, reference, KW


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_transformers(case, served):
    client, checkpoint, reference, kw = served
    ref_prompt, ref_tokens = reference_generate(checkpoint, reference, CASES[case])
    out = served_generate(client, CASES[case], kw)
    assert out["prompt_token_ids"] == ref_prompt
    assert out["choices"][0]["token_ids"] == ref_tokens
    assert out["usage"]["prompt_tokens"] == len(ref_prompt)


def test_another_video_changes_the_tokens_and_they_still_equal_transformers(served):
    """Equal tokens alone would pass with the video ignored on both sides: the tokens must follow the video."""
    client, checkpoint, reference, kw = served
    other = [make_video(3, fps=8, width=160, height=120, seed=8), CASES["one_video"][1]]
    tokens = served_generate(client, other, kw)["choices"][0]["token_ids"]
    assert tokens != served_generate(client, CASES["one_video"], kw)["choices"][0]["token_ids"]
    assert tokens == reference_generate(checkpoint, reference, other)[1]


def test_a_video_over_the_batch_budget_is_encoded_in_chunks_and_still_equals_transformers(served):
    """The Qwen2.5-VL and Qwen3-VL apps' encoders take at most 96 patches a batch: a new video of 3 tubelets of 48
    patches goes as two encoder calls (two more images encoded, no cache hit; for Qwen3-VL the first call's rows
    fill two runs, across a timestamp), and the answer is transformers' (the Qwen2-VL app, 16384 patches, encodes
    it whole: one call)."""
    client, checkpoint, reference, kw = served
    app = client.base_url.path.strip("/") or "vlm"
    if app == "q3vc":
        pytest.skip("colocated: no encoder tier")

    def encoded() -> int:
        stats = serve.get_deployment_handle("Encoder", app_name=app).broadcast("stats").results(timeout_s=60)
        return sum(int(s["images"]) for s in stats)

    parts = [make_video(3, fps=8, width=160, height=120, seed=11), "And now?"]
    before = encoded()
    tokens = served_generate(client, parts, kw)["choices"][0]["token_ids"]
    assert encoded() - before == (1 if app == "vlm" else 2)
    assert tokens == reference_generate(checkpoint, reference, parts)[1]
