"""An image's encoding cost from its grid alone (encoders/cost.py and each family's tower shape): it grows with the
image, its attention term dominates big images, Qwen2.5-VL's windows are cheaper than Qwen2-VL's full attention, a
LLaVA-1.5 image costs the same whatever its size, and the linear term is the towers' real matrices."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlavaConfig, LlavaNextConfig, Qwen2_5_VLConfig, Qwen2VLConfig
from transformers.models.clip.modeling_clip import CLIPVisionModel
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from encoders import LlavaImageProcessing, LlavaNextImageProcessing, ModelSpec, Qwen2VLImageProcessing
from encoders.llava import llava_cost
from encoders.qwen2_5_vl import qwen2_5_vl_cost
from encoders.qwen2_vl import qwen2_vl_cost

# The 7B checkpoints' vision towers (their config.json files): the shapes that matter in production.
QWEN2_VL_7B = Qwen2VLConfig(vision_config={"embed_dim": 1280, "depth": 32, "mlp_ratio": 4, "hidden_size": 3584})
QWEN2_5_VL_7B = Qwen2_5_VLConfig(
    vision_config={"hidden_size": 1280, "depth": 32, "intermediate_size": 3420, "out_hidden_size": 3584}
)
LLAVA_7B = LlavaConfig()  # CLIP ViT-L/14-336, the second-to-last layer's features, a Llama-7B width
# Qwen's processor as vLLM users often set it for documents: up to 16384 tokens (65536 patches) an image.
BIG = Qwen2VLImageProcessing(max_pixels=16384 * 28 * 28)
SIDES = [28, 56, 100, 224, 448, 640, 1024, 1536, 2048, 3000, 4096]


@pytest.mark.parametrize("config, cost_of", [(QWEN2_VL_7B, qwen2_vl_cost), (QWEN2_5_VL_7B, qwen2_5_vl_cost)])
def test_the_cost_grows_with_the_image(config, cost_of):
    cost = cost_of(config)
    grids = [BIG.grid_thw(s, s) for s in SIDES] + [BIG.grid_thw(s, 2 * s) for s in SIDES[:-1]]
    grids.sort(key=lambda g: g[1] * g[2])
    costs = [cost.gflop(g) for g in grids]
    assert all(a < b for a, b in zip(costs, costs[1:], strict=False) if a != b) and costs == sorted(costs), costs
    assert len(set(costs)) == len({g[1] * g[2] for g in grids})  # more patches always cost more


def test_attention_dominates_big_images_and_not_small_ones():
    cost = qwen2_vl_cost(QWEN2_VL_7B)
    shares = [cost.attention_share(BIG.grid_thw(s, s)) for s in SIDES]
    assert shares == sorted(shares), shares
    assert shares[SIDES.index(224)] < 0.05 < 0.5 < shares[SIDES.index(4096)], shares
    # The quadratic term: 4x the patches cost more than 4x (4x is what a linear-only cost would say).
    small, big = BIG.grid_thw(1024, 1024), BIG.grid_thw(2048, 2048)
    assert cost.gflop(big) / cost.gflop(small) > 5


def test_qwen2_5_windows_are_cheaper_than_qwen2_full_attention():
    """The two 7B towers have the same width, depth and MLP size; Qwen2.5-VL attends in 8x8-patch windows in 28 of
    its 32 layers, so at the same size it costs less, and ever less in proportion as images grow."""
    q2, q25 = qwen2_vl_cost(QWEN2_VL_7B), qwen2_5_vl_cost(QWEN2_5_VL_7B)
    assert q25.window == 64 and (q25.full_layers, q25.window_layers) == (4, 28)
    assert q25.flops_per_patch == pytest.approx(q2.flops_per_patch, rel=0.01)  # the same linear layers
    # From 224 px up: more than one window (below, both attend over the whole image).
    ratios = [q25.gflop(BIG.grid_thw(s, s)) / q2.gflop(BIG.grid_thw(s, s)) for s in SIDES[3:]]
    assert all(r < 1 for r in ratios) and ratios == sorted(ratios, reverse=True) and ratios[-1] < 0.3, ratios


def test_a_llava_image_costs_the_same_whatever_its_size_and_next_counts_its_crops():
    cost = llava_cost(LLAVA_7B)
    processing = LlavaImageProcessing(shortest_edge=336, crop_size=(336, 336))
    assert len({cost.gflop(processing.grid_thw(s, s + 7)) for s in SIDES}) == 1
    assert cost.extra_tokens == 1 and cost.full_layers == 23  # CLS; the layers up to the second to last
    nxt = llava_cost(LlavaNextConfig())
    pinpoints = ((336, 672), (672, 672))
    crops = LlavaNextImageProcessing(crop=processing, image_grid_pinpoints=pinpoints, base_size=(336, 336))
    one_row, two_rows = crops.grid_thw(600, 300), crops.grid_thw(600, 600)
    assert (one_row[0], two_rows[0]) == (3, 5)  # the base image and its tiles
    assert nxt.gflop(two_rows) == pytest.approx(nxt.gflop(one_row) * 5 / 3)


def _linear_weights(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear | nn.Conv2d | nn.Conv3d))


@pytest.mark.parametrize(
    "config, cost_of, tower",
    [
        (QWEN2_VL_7B, qwen2_vl_cost, Qwen2VisionTransformerPretrainedModel),
        (QWEN2_5_VL_7B, qwen2_5_vl_cost, Qwen2_5_VisionTransformerPretrainedModel),
    ],
)
def test_the_linear_term_is_the_towers_own_matrices(config, cost_of, tower):
    """2 FLOPs per weight per patch, the merger's per merged token: counted on the real module (on meta, no memory),
    so a field read wrongly from the config shows here."""
    with torch.device("meta"):
        vit = tower._from_config(config.vision_config)
    merger, m2 = _linear_weights(vit.merger), config.vision_config.spatial_merge_size**2
    assert cost_of(config).flops_per_patch == pytest.approx(2 * (_linear_weights(vit) - merger + merger / m2))


def test_the_llava_linear_term_is_the_layers_it_runs():
    with torch.device("meta"):
        clip = CLIPVisionModel._from_config(LLAVA_7B.vision_config)
    layers = clip.encoder.layers
    run = _linear_weights(clip) - sum(_linear_weights(layer) for layer in layers[23:])
    text, d = LLAVA_7B.text_config.hidden_size, LLAVA_7B.vision_config.hidden_size
    assert llava_cost(LLAVA_7B).flops_per_patch == pytest.approx(2 * (run + d * text + text * text))


def test_the_spec_holds_the_cost_of_its_family(checkpoint):
    spec = ModelSpec.load(checkpoint, device="cpu")
    assert spec.image_cost == qwen2_vl_cost(spec.hf_config)
    assert spec.image_cost.gflop(spec.processing.grid_thw(640, 480)) > spec.image_cost.gflop((1, 4, 4)) > 0
