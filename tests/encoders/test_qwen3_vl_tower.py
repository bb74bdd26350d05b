"""Qwen3-VL's vision tower, ours (encoders/qwen3_vl_vit.py), against transformers' `Qwen3VLVisionModel` on the same
weights: the merged embeddings and every DeepStack level, for images of different grids and a video packed in one
forward, in fp32 and bf16; and the module's imports (no transformers)."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3VLForConditionalGeneration

from demo.tiny_qwen3_vl import build_qwen3_vl_checkpoint
from encoders.qwen3_vl_vit import Qwen3VLViT

ROOT = Path(__file__).resolve().parents[2]

# Grids (t, h, w) in patches, packed into one forward. The position table is 8x8: each grid resamples it, up (12,
# 10, 14) or down (4, 6), and no two grids have the same shape.
BATCHES = {
    "two_images": [(1, 6, 10), (1, 12, 4)],
    # t = 2: 4 frames, 2 a temporal patch; each frame its own attention segment, both at the image's positions.
    "video_and_image": [(2, 8, 6), (1, 4, 14)],
}
# bf16: torch's defaults for it (rtol 1.6e-2, atol 1e-5), as tests/encoders/towers.py compares bf16 towers.
TOLERANCE = {torch.float32: {"atol": 0.0, "rtol": 0.0}, torch.bfloat16: {}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_qwen3_vl_checkpoint(tmp_path_factory.mktemp("q3") / "qwen3-vl-tiny", seed=0)


def ours_from(ckpt: Path, dtype: torch.dtype) -> Qwen3VLViT:
    """Our tower as an Encoder replica builds one: from config.json's vision_config as plain attributes, on meta, then
    given the checkpoint's `model.visual.*` tensors as they are (prefix stripped)."""
    config = types.SimpleNamespace(**json.loads((ckpt / "config.json").read_text())["vision_config"])
    prefix = "model.visual."
    weights = {
        k[len(prefix) :]: v.to(dtype) for k, v in load_file(ckpt / "model.safetensors").items() if k.startswith(prefix)
    }
    with torch.device("meta"):
        tower = Qwen3VLViT(config)
    tower.load_state_dict(weights, strict=True, assign=True)
    return tower.eval()


@pytest.fixture(scope="module")
def towers(ckpt) -> dict[torch.dtype, tuple[torch.nn.Module, Qwen3VLViT]]:
    """dtype -> (transformers' `model.visual`, ours), each all in that dtype."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        ref = Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=dtype).eval()
        out[dtype] = ref.model.visual, ours_from(ckpt, dtype)
    return out


def pixels(grids: list[tuple[int, int, int]], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random normalized patches (what the processor's mean/std 0.5 gives: about [-1, 1]) for `grids`, packed."""
    grid_thw = torch.tensor(grids)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 16 * 16, generator=generator), grid_thw


def test_parameter_names_and_shapes_are_transformers(towers):
    theirs, ours = towers[torch.float32]
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    assert len(ours.deepstack_merger_list) == len(theirs.config.deepstack_visual_indexes) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_merged_embeddings_and_deepstack_levels_match_transformers(towers, batch, dtype):
    """fp32: bit-equal (max abs difference 0): the same ops, in the same order, on the same CPU kernels, the
    interpolation weights computed by the same float32 arithmetic. bf16: within torch's bf16 defaults (measured: 0
    as well on CPU, the position embeddings summed in float32 and the rotary in float32 on both sides)."""
    theirs, ours = towers[dtype]
    pixel_values, grid_thw = pixels(BATCHES[batch], seed=0)
    with torch.no_grad():
        expected = theirs(pixel_values.to(dtype), grid_thw=grid_thw)
        embeds, deepstack = ours(pixel_values.to(dtype), grid_thw)
    tokens = int(grid_thw.prod(-1).sum()) // 4
    assert embeds.shape == (tokens, 64) and embeds.dtype == dtype
    assert len(deepstack) == len(expected.deepstack_features) == 2
    torch.testing.assert_close(embeds, expected.pooler_output, **TOLERANCE[dtype])
    for level, (o, t) in enumerate(zip(deepstack, expected.deepstack_features, strict=True)):
        assert o.shape == embeds.shape, level
        torch.testing.assert_close(o, t, **TOLERANCE[dtype], msg=lambda m, level=level: f"DeepStack level {level}: {m}")
    # Not a vacuous match: the outputs are of order 1, and the levels differ from each other and from the embeddings
    # (a swap of two would show).
    assert embeds.float().std() > 1
    assert all((a - b).abs().max() > 1 for a, b in [(deepstack[0], deepstack[1]), (deepstack[1], embeds)])


def test_a_video_frame_attends_within_itself(towers):
    # The two frames of a t = 2 video are two attention segments: each frame alone gives its own tokens.
    _, ours = towers[torch.float32]
    pixel_values, _ = pixels([(2, 8, 6)], seed=5)
    with torch.no_grad():
        video, video_deepstack = ours(pixel_values, torch.tensor([(2, 8, 6)]))
        for f, frame in enumerate(pixel_values.split(48)):
            alone, alone_deepstack = ours(frame, torch.tensor([(1, 8, 6)]))
            torch.testing.assert_close(video[12 * f : 12 * (f + 1)], alone, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(
                video_deepstack[1][12 * f : 12 * (f + 1)], alone_deepstack[1], atol=1e-5, rtol=1e-5
            )


def test_unsupported_configs_are_refused():
    config = dict(
        depth=4, hidden_size=32, intermediate_size=64, num_heads=2, hidden_act="gelu_pytorch_tanh", in_channels=3,
        patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
        deepstack_visual_indexes=[0, 2], out_hidden_size=64,
    )  # fmt: skip
    with torch.device("meta"):
        Qwen3VLViT(types.SimpleNamespace(**config))  # no rope_parameters: theta 10000, the default
        with pytest.raises(ValueError, match="square"):
            Qwen3VLViT(types.SimpleNamespace(**config | {"num_position_embeddings": 60}))
        for levels in ([2, 0], [1, 1], [0, 4]):
            with pytest.raises(ValueError, match="deepstack_visual_indexes"):
                Qwen3VLViT(types.SimpleNamespace(**config | {"deepstack_visual_indexes": levels}))


_BUILD_AND_RUN = """
import json, sys, types, torch
import encoders.qwen3_vl_vit
imported = sorted(sys.modules)
from encoders.qwen3_vl_vit import Qwen3VLViT
vc = types.SimpleNamespace(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, hidden_act="gelu_pytorch_tanh",
    in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
    deepstack_visual_indexes=[0], out_hidden_size=64)
with torch.device("meta"):
    tower = Qwen3VLViT(vc)
tower = tower.to_empty(device="cpu")
with torch.inference_mode():
    embeds, deepstack = tower(torch.zeros(2 * 4 * 6, 1536), torch.tensor([(2, 4, 6)]))
assert embeds.shape == (12, 64) and [d.shape for d in deepstack] == [(12, 64)]
print(json.dumps([imported, sorted(sys.modules)]))
"""


def test_the_tower_imports_no_transformers():
    """An Encoder replica builds it without transformers (encoders/qwen_vit.py's reason): importing the module, then
    building and running a tower, in a fresh interpreter, loads no transformers module at all."""
    out = subprocess.run(
        [sys.executable, "-c", _BUILD_AND_RUN], cwd=ROOT, capture_output=True, text=True, check=True, timeout=300
    )
    imported, ran = json.loads(out.stdout.splitlines()[-1])
    assert "encoders.qwen3_vl_vit" in imported
    for loaded in (imported, ran):
        assert [m for m in loaded if m.split(".")[0] == "transformers"] == []
