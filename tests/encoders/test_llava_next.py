"""LLaVA-NeXT tiling, token counts and packed encoder output against transformers' own image processor, processor
and model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoProcessor, LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

from demo.inputs import image_bytes, make_image
from demo.tiny_llava import build_llava_tokenizer
from demo.tiny_llava_next import GRID_PINPOINTS, build_llava_next_checkpoint, rename_to_layout
from encoders import (
    FAMILIES,
    EncoderRunner,
    ImageTokens,
    LlavaNextImageProcessing,
    LlavaNextVisionEncoder,
    ModelSpec,
    family_of,
    image_size,
    image_tokens_of,
    load_rgb,
)
from schemas import EncoderArgs

# 28 px tiles, pinpoints of 2x2 to 4x4 tiles: tiny, odd, one tile, a pinpoint's own size, wide and tall (padding
# above and below / left and right, then unpadded), so wide that no tile row is left, and larger than every pinpoint.
SIZES = [(1, 1), (5, 3), (28, 28), (56, 56), (57, 31), (120, 80), (31, 200), (640, 17), (17, 640), (333, 251)]
# The image processor as the builder writes it, and one whose short side is above the crop: then every crop is
# resized and centre-cropped again (the base image to 32x32 first).
PROCESSORS = {
    "tiles": lambda: LlavaNextImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}, image_grid_pinpoints=GRID_PINPOINTS
    ),
    "resize_then_crop": lambda: LlavaNextImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 28, "width": 28}, image_grid_pinpoints=GRID_PINPOINTS
    ),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_llava_next_checkpoint(tmp_path_factory.mktemp("llava_next") / "hub")


@pytest.fixture(scope="module")
def reference(ckpt):
    return LlavaNextForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


def _crops(pixel_values: torch.Tensor, grid: tuple[int, int, int], p: int = 14) -> torch.Tensor:
    """Our (crops*h*w, 3*p*p) patch rows -> transformers' (crops, 3, H, W)."""
    t, h, w = grid
    return pixel_values.view(t, h, w, 3, p, p).permute(0, 3, 1, 4, 2, 5).reshape(t, 3, h * p, w * p)


@pytest.fixture(scope="module", params=list(PROCESSORS))
def processors(request, ckpt, tmp_path_factory):
    """(ours, transformers') read from the same checkpoint directory, with one of the processor configs."""
    d = tmp_path_factory.mktemp(request.param)
    shutil.copy(ckpt / "config.json", d / "config.json")
    PROCESSORS[request.param]().save_pretrained(d)
    return LlavaNextImageProcessing.from_pretrained(d), LlavaNextImageProcessorPil.from_pretrained(d)


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_preprocessing_matches_transformers(processors, width, height):
    ours, ref = processors
    image = make_image(width, height, seed=width * 7 + height)
    expected = ref(images=[image], return_tensors="pt")
    pixel_values, grid = ours.preprocess(image)
    assert grid == ours.grid_thw(width, height) and grid.image_size == (height, width)
    assert [list(grid.image_size)] == expected["image_sizes"].tolist()
    torch.testing.assert_close(_crops(pixel_values, grid), expected["pixel_values"][0], atol=1e-5, rtol=0)


def _expanded_count(processor: LlavaNextProcessor, images) -> int:
    """How many `<image>` tokens transformers' own processor expands the images' placeholders to."""
    text = "USER: " + "<image>\n" * len(images) + "Describe. ASSISTANT:"
    ids = processor(text=text, images=images, return_tensors="pt")["input_ids"][0]
    return int((ids == processor.image_token_id).sum())


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_token_count_equals_the_processors_expansion(ckpt, width, height):
    ours = LlavaNextImageProcessing.from_pretrained(ckpt)
    n = ours.num_image_tokens(width, height)
    assert _expanded_count(AutoProcessor.from_pretrained(ckpt), [make_image(width, height)]) == n
    assert n <= ours.max_image_tokens


def test_counts_differ_with_the_aspect_ratio_and_have_a_largest(ckpt):
    ours = LlavaNextImageProcessing.from_pretrained(ckpt)
    # The base image's 4 tokens, then the unpadded rows of the tile map, each with its image_newline: a 120x80
    # image fills a 4x4-tile pinpoint (8x8 features) but only 6 rows of it; 640x17 keeps no row at all.
    assert [ours.num_image_tokens(w, h) for w, h in [(120, 80), (80, 120), (640, 17), (17, 640), (112, 112)]] == [
        4 + 6 * 9,
        4 + 8 * 7,
        4,
        4 + 8 * 1,
        4 + 8 * 9,
    ]
    assert ours.max_image_tokens == 76 and ours.worst_case_size() == (112, 112)
    assert max(ours.num_image_tokens(w, h) for w in range(1, 260, 7) for h in range(1, 260, 11)) == 76


def test_llava_v1_6_geometry_gives_its_counts(tmp_path):
    """LLaVA-1.6's real geometry (336 px tiles of CLIP ViT-L/14, its five pinpoints), no weights needed."""
    config = LlavaNextConfig()
    config.save_pretrained(tmp_path)
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": 336},
        crop_size={"height": 336, "width": 336},
        image_grid_pinpoints=config.image_grid_pinpoints,
    )
    image_processor.save_pretrained(tmp_path)
    ours = LlavaNextImageProcessing.from_pretrained(tmp_path)
    assert ours.max_image_tokens == 2928 and ours.worst_case_size() == (672, 672)  # 576 + 48 * 49
    assert ours.grid_thw(640, 480) == (5, 24, 24)
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=build_llava_tokenizer(),
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    # 640x480 fills the 672x672 pinpoint (2x2 tiles, 48x48 features) but only 36 of its rows: 576 + 36 * 49.
    assert _expanded_count(processor, [make_image(640, 480)]) == ours.num_image_tokens(640, 480) == 2340


def test_encoder_matches_get_image_features(ckpt, reference):
    """A batch of images with different tile counts, in one ViT forward, equals transformers' packed features."""
    images = [make_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    inputs = LlavaNextImageProcessorPil.from_pretrained(ckpt)(images=images, return_tensors="pt")
    with torch.no_grad():
        expected = reference.model.get_image_features(inputs["pixel_values"], inputs["image_sizes"]).pooler_output
    encoder = LlavaNextVisionEncoder(ckpt)
    ours = encoder.encode(images)
    counts = [encoder.processing.num_image_tokens(*image.size) for image in images]
    assert [o.shape for o in ours] == [e.shape for e in expected] == [(n, 64) for n in counts]
    for o, e in zip(ours, expected, strict=True):
        torch.testing.assert_close(o, e, atol=1e-5, rtol=1e-5)
    # 120x80: the base's 4 rows, then 6 rows of 8 tile features, each followed by image_newline.
    newline_rows = ours[5][4:].view(6, 9, 64)[:, -1]
    torch.testing.assert_close(newline_rows, reference.model.image_newline.detach().expand(6, 64), atol=0, rtol=0)
    # Batched equals one at a time.
    for image, o in zip(images[:4], ours[:4], strict=True):
        torch.testing.assert_close(encoder.encode([image])[0], o, atol=1e-5, rtol=1e-5)


def test_the_tower_and_projector_are_ours_not_transformers(ckpt):
    # encoders/clip_vit.py, as LLaVA-1.5's: no transformers modeling to build them (tests/test_replica_imports.py)
    encoder = LlavaNextVisionEncoder(ckpt)
    assert type(encoder.tower).__module__ == type(encoder.projector).__module__ == "encoders.clip_vit"


@pytest.mark.parametrize("layout", ["legacy", "prefixed"])
def test_every_layout_gives_the_same_weights_and_embeddings(layout, ckpt, reference, tmp_path):
    other = shutil.copytree(ckpt, tmp_path / layout)
    rename_to_layout(other / "model.safetensors", layout)
    # transformers reads this layout too, to the same weights: it is a layout real checkpoints have.
    ref_other = LlavaNextForConditionalGeneration.from_pretrained(other, dtype=torch.float32).state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(tensor, ref_other[name]), name
    a, b = LlavaNextVisionEncoder(ckpt), LlavaNextVisionEncoder(other)
    assert torch.equal(a.image_newline, b.image_newline)
    image = make_image(90, 60, seed=4)
    assert torch.equal(a.encode([image])[0], b.encode([image])[0])


def test_registry_picks_llava_next(ckpt, reference):
    assert family_of(ckpt) is FAMILIES["llava_next"]
    assert image_tokens_of(ckpt) == ImageTokens(reference.config.image_token_id, (), ())


def test_full_feature_strategy_is_refused(ckpt, tmp_path):
    """transformers cannot pack "full" features (the CLS token does not fit the tile grid): refused at start."""
    shutil.copy(ckpt / "preprocessor_config.json", tmp_path / "preprocessor_config.json")
    config = json.loads((ckpt / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vision_feature_select_strategy": "full"}))
    with pytest.raises(ValueError, match="vision_feature_select_strategy 'full' is not supported for LLaVA-NeXT"):
        LlavaNextImageProcessing.from_pretrained(tmp_path)


def test_runner_projector_dtype_and_jpeg_draft(ckpt):
    """The family's projector path is real (bf16 tower, fp32 projector, start-up check on the worst case), and a
    JPEG decoded at a reduced scale keeps its tiles and its token count."""
    image = make_image(333, 251, seed=3)
    full = LlavaNextVisionEncoder(ckpt).encode([image])[0]
    runner = EncoderRunner(
        ModelSpec.load(ckpt, device="cpu", dtype="float32"),
        EncoderArgs(vision_dtype="bfloat16", projector_dtype="float32"),
    )
    out = runner.encoder.encode([image])[0]
    assert out.dtype == torch.float32 and out.shape == full.shape
    assert 0 < ((out - full).norm() / full.norm()).item() < 0.05
    processing = runner.processing
    data = image_bytes(make_image(1600, 600, seed=9), "JPEG")
    size = image_size(data)
    exact, grid = processing.preprocess(load_rgb(data))
    draft, grid_draft = processing.preprocess(load_rgb(data, draft_size=processing.resized_size(*size)), size)
    assert load_rgb(data, draft_size=processing.resized_size(*size)).size != size  # it did decode smaller
    assert grid_draft == grid and grid_draft.image_size == grid.image_size == (600, 1600)
    assert (draft - exact).abs().mean() < 0.1
