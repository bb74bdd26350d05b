"""Qwen2-VL preprocessing and encoder against transformers' own image processor and model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from demo.inputs import image_bytes, make_image
from encoders import Qwen2VLImageProcessing, Qwen2VLVisionEncoder, load_rgb, smart_resize
from encoders.video_processing import Qwen2VLVideoProcessing
from tests.encoders.towers import assert_matches_visual

# Tiny, odd, very wide and very tall, larger than max_pixels (downscaled), and exact multiples of 28.
SIZES = [(1, 1), (5, 3), (28, 28), (57, 31), (199, 3), (3, 500), (640, 17), (333, 251), (1000, 700), (224, 448)]


@pytest.mark.parametrize("max_pixels", [28 * 28 * 64, 28 * 28 * 1280])
@pytest.mark.parametrize(("width", "height"), SIZES)
def test_preprocessing_matches_transformers(width, height, max_pixels):
    image = make_image(width, height, seed=width * 7 + height)
    ref = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=max_pixels)(images=[image], return_tensors="pt")
    ours = Qwen2VLImageProcessing(min_pixels=56 * 56, max_pixels=max_pixels)
    pixel_values, grid = ours.preprocess(image)
    assert grid == tuple(ref["image_grid_thw"][0].tolist())
    torch.testing.assert_close(pixel_values, ref["pixel_values"], atol=1e-5, rtol=0)
    # The ingress's count from the size alone agrees with what preprocessing produces.
    assert ours.num_image_tokens(width, height) == pixel_values.shape[0] // 4


@pytest.mark.parametrize(("height", "width"), [(1, 1), (27, 29), (4000, 30), (10, 1999), (5000, 5000), (56, 56)])
def test_smart_resize_matches_transformers(height, width):
    for max_pixels in (28 * 28 * 4, 28 * 28 * 1280):
        assert smart_resize(height, width, 28, 56 * 56, max_pixels) == hf_smart_resize(
            height, width, 28, 56 * 56, max_pixels
        )


def test_processing_config_read_from_checkpoint(checkpoint):
    p = Qwen2VLImageProcessing.from_pretrained(checkpoint)
    ref = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)
    assert (p.min_pixels, p.max_pixels) == (ref.size["shortest_edge"], ref.size["longest_edge"])
    assert (p.patch_size, p.merge_size, p.temporal_patch_size) == (
        ref.patch_size,
        ref.merge_size,
        ref.temporal_patch_size,
    )


def test_transparent_image_composited_on_white_like_transformers(checkpoint):
    image = make_image(90, 60, seed=3, mode="RGBA")
    image.putalpha(image.getchannel("R"))  # varied transparency
    ref = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)(images=[image], return_tensors="pt")
    ours, _ = Qwen2VLImageProcessing.from_pretrained(checkpoint).preprocess(load_rgb(image_bytes(image)))
    torch.testing.assert_close(ours, ref["pixel_values"], atol=1e-5, rtol=0)


def test_encoder_matches_get_image_features(checkpoint, reference):
    encoder = Qwen2VLVisionEncoder(checkpoint)
    images = [make_image(57, 31, seed=1), make_image(300, 120, seed=2), make_image(28, 200, seed=3)]
    ours = encoder.encode(images)
    processed = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)(images=images, return_tensors="pt")
    with torch.no_grad():
        ref = reference.model.get_image_features(processed["pixel_values"], processed["image_grid_thw"]).pooler_output
    assert [e.shape for e in ours] == [r.shape for r in ref]
    for o, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)


def test_encoder_holds_only_vision_weights(checkpoint, legacy_checkpoint, reference):
    for ckpt in (checkpoint, legacy_checkpoint):
        encoder = Qwen2VLVisionEncoder(ckpt)
        ours = encoder.vit.state_dict()
        vision = reference.model.visual.state_dict()
        assert set(ours) == set(vision)  # nothing of the language model, nothing missing
        for name, tensor in ours.items():
            torch.testing.assert_close(tensor, vision[name], atol=0, rtol=0)
        n_params = sum(p.numel() for p in encoder.vit.parameters())
        assert n_params == sum(p.numel() for p in reference.model.visual.parameters())


def test_the_tower_is_ours_not_transformers(checkpoint):
    # encoders/qwen_vit.py: an Encoder replica builds it without transformers' modeling (tests/test_replica_imports.py)
    assert type(Qwen2VLVisionEncoder(checkpoint).vit).__module__ == "encoders.qwen_vit"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_video_and_images_of_different_sizes_in_one_forward_match_transformers(checkpoint, reference, dtype):
    encoder = Qwen2VLVisionEncoder(checkpoint, dtype=dtype)
    images = [encoder.preprocess(make_image(w, h, seed=i)) for i, (w, h) in enumerate([(57, 31), (300, 120)])]
    frames = np.stack([np.asarray(make_image(168, 84, seed=10 + i)) for i in range(4)])  # 4 frames: t = 2 tubelets
    video = Qwen2VLVideoProcessing().preprocess(frames)
    assert video[1] == (2, 6, 12)
    batch = [images[0], video, images[1]]
    ours = encoder.forward(batch)
    ref = (
        reference
        if dtype == torch.float32
        else Qwen2VLForConditionalGeneration.from_pretrained(checkpoint, dtype=dtype)
    )
    assert_matches_visual(ours, ref.model.visual, batch, dtype)
