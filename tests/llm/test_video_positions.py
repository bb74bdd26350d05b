"""Video M-RoPE positions against transformers' get_rope_index (the pinned 5.23): Qwen2-VL's temporal index is the
tubelet's, Qwen2.5-VL's int(tubelet * tokens_per_second * second_per_grid_t), multiplied before the truncation;
videos sampled at 1, 2 and 4 fps (4 fps: 0.5 s per tubelet, where truncating first would give other positions)."""

from __future__ import annotations

import functools
import types

import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

from encoders.video_processing import Qwen2VLVideoProcessing, SamplingRequest, VideoMeta
from llm.model.model import mrope_positions, video_time_interval

IMG, VID = 9, 10


def _reference(model_class, config):
    """transformers' get_rope_index without building the model: it reads only the config."""
    stub = types.SimpleNamespace(config=config)
    stub.get_vision_position_ids = functools.partial(model_class.get_vision_position_ids, stub)
    return functools.partial(model_class.get_rope_index, stub)


def _prompt(video_tokens: int, image_tokens: int) -> torch.Tensor:
    ids = [1, 2, 3] + [VID] * video_tokens + [4, 5] + [IMG] * image_tokens + [6, 7, 8]
    return torch.tensor(ids)


@pytest.mark.parametrize("fps", [1.0, 2.0, 4.0])
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl_tps2", "qwen2_5_vl_tps3"])
def test_video_then_image_positions_equal_get_rope_index(family, fps):
    proc = Qwen2VLVideoProcessing(min_pixels=4 * 28 * 28, max_pixels=8 * 28 * 28)
    plan = proc.plan(VideoMeta(64, 8.0, 80, 60), SamplingRequest(fps=fps), 10**9)  # 8 s: 8, 16, 32 frames
    assert plan.sample_fps == fps and len(plan.indices) == 8 * fps
    image_grid = (1, 4, 6)
    if family == "qwen2_vl":
        config, model_class, tps = Qwen2VLConfig(), Qwen2VLModel, None
    else:
        tps = int(family[-1])
        config = Qwen2_5_VLConfig(vision_config={"tokens_per_second": tps})
        model_class = Qwen2_5_VLModel
    ids = _prompt(plan.num_tokens, 6)
    ours, delta = mrope_positions(
        ids, IMG, [plan.grid_thw, image_grid], 2, video_token_id=VID,
        time_intervals=[video_time_interval(plan.second_per_grid_t, tps), None],
    )  # fmt: skip
    kwargs = dict(
        mm_token_type_ids=((ids == IMG).int() + 2 * (ids == VID).int())[None],
        image_grid_thw=torch.tensor([image_grid]),
        video_grid_thw=torch.tensor([plan.grid_thw]),
    )
    if tps is not None:  # as the processor's BatchFeature hands it to generate: a float32 tensor
        kwargs["second_per_grid_ts"] = torch.tensor([plan.second_per_grid_t])
    ref, ref_delta = _reference(model_class, config)(ids[None], **kwargs)
    torch.testing.assert_close(ours, ref[:, 0])
    assert delta == int(ref_delta)
    temporal = ours[0, 3 : 3 + plan.num_tokens].unique().tolist()
    step = 1.0 if tps is None else tps * 2 / fps
    assert temporal == [3 + int(t * step) for t in range(plan.grid_thw[0])]  # 4 fps, 3 tokens/s: 0, 1, 3, 4, 6...
