"""LLaVA-1.5 preprocessing, token counts and encoder against transformers' own image processor, processor and model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoImageProcessor, AutoProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

from demo.inputs import image_bytes, make_image
from demo.tiny_llava import build_llava_checkpoint, build_llava_tokenizer
from encoders import (
    FAMILIES,
    EncoderRunner,
    ImageTokens,
    LlavaImageProcessing,
    LlavaVisionEncoder,
    ModelSpec,
    family_of,
    image_size,
    image_tokens_of,
    load_rgb,
)
from schemas import EncoderArgs

# Tiny, odd, square at the crop size, very wide and very tall, larger than the crop.
SIZES = [(1, 1), (5, 3), (56, 56), (57, 31), (120, 80), (31, 200), (640, 17), (333, 251)]
# Image processor configs as llava-hf checkpoints have them: LlavaImageProcessor (centre crop, or LLaVA-1.5's pad
# to square), CLIPImageProcessor (the older files), and a short side below the crop (the crop pads with zeros).
PROCESSORS = {
    "llava_crop": lambda: LlavaImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}),
    "llava_pad": lambda: LlavaImageProcessorPil(
        size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}, do_pad=True
    ),
    "clip": lambda: CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}),
    "short_side_below_crop": lambda: LlavaImageProcessorPil(
        size={"shortest_edge": 45}, crop_size={"height": 56, "width": 56}
    ),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_llava_checkpoint(tmp_path_factory.mktemp("llava") / "hub")


@pytest.fixture(scope="module")
def reference(ckpt):
    return LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


def _unpatchify(pixel_values: torch.Tensor, grid: tuple[int, int, int], p: int = 14) -> torch.Tensor:
    """Our (h*w, 3*p*p) patch rows -> transformers' (3, H, W) image."""
    _, h, w = grid
    return pixel_values.view(h, w, 3, p, p).permute(2, 0, 3, 1, 4).reshape(3, h * p, w * p)


@pytest.fixture(scope="module", params=list(PROCESSORS))
def processors(request, ckpt, tmp_path_factory):
    """(ours, transformers') read from the same checkpoint directory, with one of the processor configs."""
    d = tmp_path_factory.mktemp(request.param)
    shutil.copy(ckpt / "config.json", d / "config.json")
    PROCESSORS[request.param]().save_pretrained(d)
    return LlavaImageProcessing.from_pretrained(d), AutoImageProcessor.from_pretrained(d)


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_preprocessing_matches_transformers(processors, width, height):
    ours, ref = processors
    image = make_image(width, height, seed=width * 7 + height)
    expected = ref(images=[image], return_tensors="pt")["pixel_values"][0]  # (3, H, W)
    pixel_values, grid = ours.preprocess(image)
    assert grid == (1, 4, 4) and pixel_values.shape == (16, 3 * 14 * 14)
    torch.testing.assert_close(_unpatchify(pixel_values, grid), expected, atol=1e-5, rtol=0)


def test_pad_and_crop_settings_are_read_from_the_checkpoint(ckpt, tmp_path):
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    LlavaImageProcessorPil(
        size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}, do_pad=True, do_center_crop=False
    ).save_pretrained(tmp_path)
    p = LlavaImageProcessing.from_pretrained(tmp_path)
    assert p.do_pad and not p.do_center_crop and p.out_size == (56, 56)
    # transformers 5 nests the image processor in processor_config.json: read there when it is not on its own
    (tmp_path / "preprocessor_config.json").unlink()
    shutil.copy(ckpt / "processor_config.json", tmp_path / "processor_config.json")
    assert LlavaImageProcessing.from_pretrained(tmp_path) == LlavaImageProcessing.from_pretrained(ckpt)
    # The fingerprint (embedding cache keys) changes with anything that changes the pixels.
    assert p.fingerprint() != LlavaImageProcessing.from_pretrained(ckpt).fingerprint()


def test_a_crop_the_vision_tower_cannot_take_is_refused(ckpt, tmp_path):
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    LlavaImageProcessorPil(size={"shortest_edge": 70}, crop_size={"height": 70, "width": 70}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="preprocessing gives 70x70 images but the vision tower takes 56x56"):
        LlavaImageProcessing.from_pretrained(tmp_path)


def _expanded_count(processor: LlavaProcessor, images) -> int:
    """How many `<image>` tokens transformers' own processor expands the images' placeholders to."""
    text = "USER: " + "<image>\n" * len(images) + "Describe. ASSISTANT:"
    ids = processor(text=text, images=images, return_tensors="pt")["input_ids"][0]
    return int((ids == processor.image_token_id).sum())


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_token_count_equals_the_processors_expansion(strategy, tmp_path):
    ckpt = build_llava_checkpoint(tmp_path / strategy, select_strategy=strategy)
    ours = LlavaImageProcessing.from_pretrained(ckpt)
    images = [make_image(120, 80, seed=1), make_image(31, 200, seed=2)]
    n = ours.num_image_tokens(120, 80)
    assert n == ours.num_image_tokens(31, 200) == ours.max_image_tokens == 16 + (strategy == "full")
    assert _expanded_count(AutoProcessor.from_pretrained(ckpt), images) == 2 * n
    assert [e.shape[0] for e in LlavaVisionEncoder(ckpt).encode(images)] == [n, n]


def test_llava_1_5_336px_patch14_gives_576_tokens(tmp_path):
    """LLaVA-1.5's real geometry, from its config and image processor (no weights needed)."""
    config = LlavaConfig()  # llava-1.5-7b-hf's defaults: CLIP ViT-L/14 at 336px
    assert (config.vision_config.image_size, config.vision_config.patch_size) == (336, 14)
    config.save_pretrained(tmp_path)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    image_processor.save_pretrained(tmp_path)
    ours = LlavaImageProcessing.from_pretrained(tmp_path)
    assert ours.num_image_tokens(640, 480) == ours.max_image_tokens == config.image_seq_length == 576
    assert ours.grid_thw(640, 480) == (1, 24, 24)
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=build_llava_tokenizer(),
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    assert _expanded_count(processor, [make_image(640, 480)]) == 576


@pytest.mark.parametrize("strategy", ["default", "full"])
@pytest.mark.parametrize("layer", [-2, [-3, -1]], ids=["second_to_last", "concat_embeddings_and_last"])
def test_encoder_matches_get_image_features(layer, strategy, tmp_path):
    ckpt = build_llava_checkpoint(tmp_path / "ckpt", select_strategy=strategy, feature_layer=layer)
    reference = LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    images = [make_image(120, 80, seed=1), make_image(31, 200, seed=2), make_image(56, 56, seed=3)]
    pixel_values = AutoImageProcessor.from_pretrained(ckpt)(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = reference.model.get_image_features(pixel_values).pooler_output
    encoder = LlavaVisionEncoder(ckpt)
    ours = encoder.encode(images)
    assert [o.shape for o in ours] == [e.shape for e in expected] == [(16 + (strategy == "full"), 64)] * 3
    for o, e in zip(ours, expected, strict=True):
        torch.testing.assert_close(o, e, atol=1e-5, rtol=1e-5)
    # Batched equals one at a time.
    for image, o in zip(images, ours, strict=True):
        torch.testing.assert_close(encoder.encode([image])[0], o, atol=1e-5, rtol=1e-5)


def test_the_tower_and_projector_are_ours_not_transformers(ckpt):
    # encoders/clip_vit.py: an Encoder replica builds them without transformers' modeling (test_replica_imports.py)
    encoder = LlavaVisionEncoder(ckpt)
    assert type(encoder.tower).__module__ == type(encoder.projector).__module__ == "encoders.clip_vit"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layer", [-2, [-3, -1]], ids=["second_to_last", "concat_embeddings_and_last"])
def test_the_same_pixels_give_transformers_features_bit_for_bit(layer, dtype, tmp_path):
    """Our tower and projector run transformers' ops in transformers' order (its sdpa attention): on the same pixels
    (no preprocessing in between), the features are get_image_features' exactly, in float32 and in bfloat16."""
    ckpt = build_llava_checkpoint(tmp_path / "ckpt", select_strategy="full", feature_layer=layer)
    reference = LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=dtype).eval()
    pixel_values = torch.randn(3, 3, 56, 56, generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.inference_mode():
        expected = torch.stack(reference.model.get_image_features(pixel_values).pooler_output)
        ours = LlavaVisionEncoder(ckpt, dtype=dtype).features(pixel_values)
    assert ours.dtype == expected.dtype == dtype and ours.shape == expected.shape == (3, 17, 64)
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)


def test_a_checkpoint_that_saved_the_position_ids_loads(ckpt, tmp_path):
    """Older CLIP checkpoints saved the embeddings' `position_ids` (an arange; transformers ignores it): our tower,
    which has no such buffer, loads them all the same."""
    other = shutil.copytree(ckpt, tmp_path / "with_position_ids")
    weights = load_file(other / "model.safetensors")
    weights["vision_tower.vision_model.embeddings.position_ids"] = torch.arange(17).unsqueeze(0)
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    image = make_image(90, 60, seed=4)
    assert torch.equal(LlavaVisionEncoder(other).encode([image])[0], LlavaVisionEncoder(ckpt).encode([image])[0])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_act", "gelu_10", "unsupported CLIP hidden_act 'gelu_10'"),
        ("projector_hidden_act", "relu6", "unsupported LLaVA projector_hidden_act 'relu6'"),
    ],
)
def test_an_activation_we_do_not_have_is_refused(ckpt, tmp_path, field, value, message):
    other = shutil.copytree(ckpt, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (config["vision_config"] if field == "hidden_act" else config)[field] = value
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LlavaVisionEncoder(other)


def test_encoder_holds_only_the_tower_layers_it_uses_and_the_projector(ckpt, reference):
    encoder = LlavaVisionEncoder(ckpt)  # vision_feature_layer -2 of 2 layers: the last layer is never used
    assert len(encoder.tower.encoder.layers) == 1
    tower, ref_tower = encoder.tower.state_dict(), reference.model.vision_tower.state_dict()
    assert set(ref_tower) - set(tower) == {k for k in ref_tower if k.startswith("encoder.layers.1.")}
    for name, tensor in tower.items():
        torch.testing.assert_close(tensor, ref_tower[name], atol=0, rtol=0)
    projector = reference.model.multi_modal_projector.state_dict()
    assert encoder.projector.state_dict().keys() == projector.keys()
    for name, tensor in encoder.projector.state_dict().items():
        torch.testing.assert_close(tensor, projector[name], atol=0, rtol=0)


@pytest.mark.parametrize("layout", ["legacy", "prefixed"])
def test_every_layout_gives_the_same_weights_and_embeddings(layout, ckpt, reference, tmp_path):
    other = build_llava_checkpoint(tmp_path / layout, layout=layout)
    # transformers reads this layout too, to the same weights: it is a layout real checkpoints have.
    ref_other = LlavaForConditionalGeneration.from_pretrained(other, dtype=torch.float32).state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(tensor, ref_other[name]), name
    a, b = LlavaVisionEncoder(ckpt), LlavaVisionEncoder(other)
    for part in ("tower", "projector"):
        sa, sb = getattr(a, part).state_dict(), getattr(b, part).state_dict()
        assert sa.keys() == sb.keys()
        for name in sa:
            assert torch.equal(sa[name], sb[name]), name
    image = make_image(90, 60, seed=4)
    assert torch.equal(a.encode([image])[0], b.encode([image])[0])


def test_registry_picks_llava(ckpt, reference):
    assert family_of(ckpt) is FAMILIES["llava"]
    assert image_tokens_of(ckpt) == ImageTokens(reference.config.image_token_id, (), ())
    assert reference.config.image_token_id == build_llava_tokenizer().convert_tokens_to_ids("<image>")


def test_runner_places_the_projector_on_its_own_dtype(ckpt):
    """The family's projector path is real: a bf16 tower with an fp32 projector, and the start-up check runs."""
    image = make_image(96, 72, seed=3)
    full = LlavaVisionEncoder(ckpt).encode([image])[0]
    runner = EncoderRunner(
        ModelSpec.load(ckpt, device="cpu", dtype="float32"),
        EncoderArgs(vision_dtype="bfloat16", projector_dtype="float32"),
    )
    assert next(runner.encoder.tower.parameters()).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in runner.encoder.projector.parameters())
    out = runner.encoder.encode([image])[0]
    assert out.dtype == torch.float32 and out.shape == full.shape
    assert 0 < ((out - full).norm() / full.norm()).item() < 0.05


@pytest.mark.parametrize("do_pad", [False, True], ids=["crop", "pad"])
def test_jpeg_draft_keeps_the_grid_and_stays_close(do_pad):
    processing = LlavaImageProcessing(shortest_edge=56, crop_size=(56, 56), do_pad=do_pad)
    data = image_bytes(make_image(1600, 1200, seed=9), "JPEG")
    size = image_size(data)
    full, grid_full = processing.preprocess(load_rgb(data))
    draft, grid_draft = processing.preprocess(load_rgb(data, draft_size=processing.resized_size(*size)), size)
    assert grid_draft == grid_full == (1, 4, 4)
    assert (draft - full).abs().mean() < 0.1  # close, not equal: why it is opt-in
