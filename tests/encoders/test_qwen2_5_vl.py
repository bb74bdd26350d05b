"""Qwen2.5-VL: preprocessing, token counts, encoder and weight loading against transformers; the LM's config and
M-RoPE positions against Qwen2.5-VL's own."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.processing_utils import ProcessorMixin
from transformers.vision_utils import get_vision_window_index

from demo.inputs import make_image
from demo.tiny_qwen2_5_vl import build_qwen2_5_vl_checkpoint
from encoders import (
    EncoderRunner,
    ModelSpec,
    Qwen2_5_VLVisionEncoder,
    Qwen2VLImageProcessing,
    family_of,
    image_tokens_of,
)
from encoders.video_processing import Qwen2VLVideoProcessing
from llm import TextConfig
from llm.model import mrope_positions
from schemas import EncoderArgs
from tests.encoders.towers import assert_matches_visual

# Tiny, odd, very wide and very tall, larger than max_pixels (downscaled), and exact multiples of 28.
SIZES = [(1, 1), (5, 3), (57, 31), (199, 3), (3, 500), (640, 17), (333, 251), (1000, 700), (224, 448)]
# Different sizes in one forward; each covers several windows (2x2 merged tokens each), some of them partial.
BATCH = [(120, 80), (300, 140), (40, 260)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_qwen2_5_vl_checkpoint(tmp_path_factory.mktemp("q25") / "qwen2.5-vl-tiny", seed=1)


@pytest.fixture(scope="module")
def legacy_ckpt(tmp_path_factory):
    return build_qwen2_5_vl_checkpoint(
        tmp_path_factory.mktemp("q25") / "qwen2.5-vl-tiny-legacy", seed=1, layout="legacy"
    )


@pytest.fixture(scope="module")
def ref(ckpt):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture
def processor(ckpt, monkeypatch):
    """transformers' Qwen2_5_VLProcessor. NOTE: its constructor checks the video processor's class through a
    mapping that needs torchvision (not installed); that check alone is skipped, images never touch video code."""
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    return Qwen2_5_VLProcessor(
        image_processor=AutoImageProcessor.from_pretrained(ckpt),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=tokenizer.chat_template,
    )


def test_registry_picks_the_family_from_config_json(ckpt):
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    family = family_of(ckpt)
    assert family.encoder is Qwen2_5_VLVisionEncoder and family.processing is Qwen2VLImageProcessing
    tokens, tokenizer = image_tokens_of(ckpt), AutoTokenizer.from_pretrained(ckpt)
    assert tokens.placeholder_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert tokens.per_image_ids == tuple(tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"]))
    assert tokens.forbidden_ids == () and tokens.video_placeholder_id == tokenizer.convert_tokens_to_ids(
        "<|video_pad|>"
    )


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_preprocessing_matches_transformers(ckpt, width, height):
    image = make_image(width, height, seed=width * 7 + height)
    ref = AutoImageProcessor.from_pretrained(ckpt)(images=[image], return_tensors="pt")
    ours = family_of(ckpt).processing.from_pretrained(ckpt)
    pixel_values, grid = ours.preprocess(image)
    assert grid == tuple(ref["image_grid_thw"][0].tolist())
    torch.testing.assert_close(pixel_values, ref["pixel_values"], atol=1e-5, rtol=0)


def test_processing_config_is_read_from_the_hub_format(ckpt):
    # Hub Qwen2.5-VL files give min/max_pixels at the top level (no size{}); both readers must take them.
    ours, theirs = Qwen2VLImageProcessing.from_pretrained(ckpt), AutoImageProcessor.from_pretrained(ckpt)
    assert (ours.min_pixels, ours.max_pixels) == (theirs.size["shortest_edge"], theirs.size["longest_edge"])
    assert (ours.min_pixels, ours.max_pixels) == (56 * 56, 28 * 28 * 64)
    assert (ours.patch_size, ours.merge_size, ours.temporal_patch_size) == (14, 2, 2)
    assert (ours.image_mean, ours.image_std) == (tuple(theirs.image_mean), tuple(theirs.image_std))


def test_token_counts_equal_the_processors_expansion(ckpt, processor):
    images = [make_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    ours = family_of(ckpt).processing.from_pretrained(ckpt)
    text = "<|vision_start|><|image_pad|><|vision_end|> and " * len(images)
    out = processor(text=[text], images=images, return_tensors="pt")
    pad = processor.image_token_id
    ids = out["input_ids"][0].tolist()
    # Each image's run of placeholders, in order, as the processor expanded it.
    runs, n = [], 0
    for tok in ids + [None]:
        if tok == pad:
            n += 1
        elif n:
            runs, n = runs + [n], 0
    counts = [ours.num_image_tokens(w, h) for w, h in SIZES]
    assert runs == counts
    assert counts == (out["image_grid_thw"].prod(-1) // 4).tolist()
    assert counts == processor._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in SIZES]).num_image_tokens


def test_encoder_matches_get_image_features_on_a_batch(ckpt, ref):
    encoder = Qwen2_5_VLVisionEncoder(ckpt)
    images = [make_image(w, h, seed=i) for i, (w, h) in enumerate(BATCH)]
    batch = [encoder.preprocess(im) for im in images]
    # The checkpoint must exercise window attention: windowed and full blocks, several windows per image.
    vc = ref.config.vision_config
    assert 0 < len(vc.fullatt_block_indexes) < vc.depth
    for _, grid in batch:
        _, cu_windows = get_vision_window_index(
            torch.tensor([grid]), vc.spatial_merge_size, vc.window_size, vc.patch_size
        )
        assert len(cu_windows) - 1 >= 4, grid
    ours = encoder.forward(batch)  # all three in one forward
    processed = AutoImageProcessor.from_pretrained(ckpt)(images=images, return_tensors="pt")
    with torch.no_grad():
        theirs = ref.get_image_features(processed["pixel_values"], processed["image_grid_thw"]).pooler_output
    assert [o.shape for o in ours] == [t.shape for t in theirs] == [(12, 64), (55, 64), (9, 64)]
    for o, t in zip(ours, theirs, strict=True):
        torch.testing.assert_close(o, t, atol=1e-5, rtol=1e-5)
    assert encoder.hidden_size == ref.config.text_config.hidden_size == 64  # vision_config.out_hidden_size
    # Alone, each image gets the same embedding as in the batch.
    for (pv, grid), o in zip(batch, ours, strict=True):
        torch.testing.assert_close(encoder.forward([(pv, grid)])[0], o, atol=1e-4, rtol=1e-5)


def test_the_tower_is_ours_not_transformers(ckpt):
    # encoders/qwen_vit.py: an Encoder replica builds it without transformers' modeling (tests/test_replica_imports.py)
    assert type(Qwen2_5_VLVisionEncoder(ckpt).vit).__module__ == "encoders.qwen_vit"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_video_and_images_of_different_sizes_in_one_forward_match_transformers(ckpt, ref, dtype):
    encoder = Qwen2_5_VLVisionEncoder(ckpt, dtype=dtype)
    images = [encoder.preprocess(make_image(w, h, seed=i)) for i, (w, h) in enumerate(BATCH)]
    # 4 frames: t = 2 tubelets, each a 3x7 grid of merged tokens, so 2x4 windows a frame, partial at the edges
    frames = np.stack([np.asarray(make_image(196, 84, seed=10 + i)) for i in range(4)])
    video = Qwen2VLVideoProcessing().preprocess(frames)
    assert video[1] == (2, 6, 14)
    batch = [images[0], video, *images[1:]]
    ours = encoder.forward(batch)
    ref = ref if dtype == torch.float32 else Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt, dtype=dtype)
    assert_matches_visual(ours, ref.model.visual, batch, dtype)


def test_encoder_loads_only_vision_weights_from_both_layouts(ckpt, legacy_ckpt, ref):
    vision = ref.model.visual.state_dict()
    images = [make_image(w, h, seed=i) for i, (w, h) in enumerate(BATCH)]
    outputs = []
    for path in (ckpt, legacy_ckpt):
        encoder = Qwen2_5_VLVisionEncoder(path)
        ours = encoder.vit.state_dict()
        assert set(ours) == set(vision)  # nothing of the language model, nothing missing
        for name, tensor in ours.items():
            torch.testing.assert_close(tensor, vision[name], atol=0, rtol=0)
        outputs.append(encoder.encode(images))
    for hub, legacy in zip(*outputs, strict=True):
        torch.testing.assert_close(hub, legacy, atol=0, rtol=0)


def test_bf16_tower_with_an_fp32_projector(ckpt):
    # The family's projector path ("vit.merger") is placeable: the merger's output is reordered after it.
    image = make_image(120, 80, seed=3)
    runner = EncoderRunner(
        ModelSpec.load(ckpt, device="cpu", dtype="float32"),
        EncoderArgs(vision_dtype="bfloat16", projector_dtype="float32"),
    )
    assert next(runner.encoder.vit.blocks.parameters()).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in runner.encoder.vit.merger.parameters())
    full = Qwen2_5_VLVisionEncoder(ckpt).encode([image])[0]
    out = runner.encoder.encode([image])[0]
    assert out.dtype == torch.float32 and out.shape == full.shape
    assert 0 < ((out - full).norm() / full.norm()).item() < 0.05


def test_text_config_of_a_hub_checkpoint(tmp_path):
    # A Qwen2.5-VL-7B-Instruct config.json as the hub has it (flat text fields, `rope_scaling` of type mrope).
    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "max_position_embeddings": 128000, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "sliding_window": 32768,
        "use_sliding_window": False, "max_window_layers": 28, "tie_word_embeddings": False, "vocab_size": 152064,
        "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "hidden_act": "silu",
        "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                          "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                          "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                          "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    c = TextConfig.from_pretrained(tmp_path)
    assert (c.mrope_section, c.rope_theta, c.tie_word_embeddings) == ((16, 24, 24), 1000000.0, False)
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers) == (3584, 28, 4, 128, 28)
    assert (c.vocab_size, c.rms_norm_eps, c.max_position_embeddings) == (152064, 1e-06, 128000)
    # Pre-v5 saves put tie_word_embeddings in text_config (the 3B does tie); transformers moves it up, so do we.
    text_keys = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rope_theta",
        "rope_scaling",
        "vocab_size",
    )
    nested = {k: v for k, v in config.items() if k not in text_keys and k != "tie_word_embeddings"}
    nested["text_config"] = {k: config[k] for k in text_keys} | {"tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert TextConfig.from_pretrained(tmp_path).tie_word_embeddings is True


def test_text_config_of_the_tiny_checkpoint(ckpt, ref):
    c, tc = TextConfig.from_pretrained(ckpt), ref.config.text_config
    assert c.mrope_section == tuple(tc.rope_parameters["mrope_section"])
    assert c.rope_theta == tc.rope_parameters["rope_theta"] == 1000000.0
    assert c.tie_word_embeddings is False and c.head_dim == tc.hidden_size // tc.num_attention_heads


@pytest.mark.parametrize("second_per_grid_t", [None, 0.5, 2.0])
def test_mrope_positions_match_qwen2_5_vl_get_rope_index(ref, second_per_grid_t):
    # Three images of different grids, text between and after, an image at the very start; for still images
    # Qwen2.5-VL's temporal spacing (tokens_per_second * second_per_grid_t) does not apply.
    img = ref.config.image_token_id
    grids = [(1, 4, 6), (1, 2, 2), (1, 8, 2)]
    runs = [("img", 6), ("txt", 3), ("img", 1), ("txt", 5), ("img", 4), ("txt", 2)]
    ids = torch.tensor([t for kind, n in runs for t in ([img] * n if kind == "img" else range(1, n + 1))])
    ours, delta = mrope_positions(ids, img, grids, merge_size=2)
    kwargs = {} if second_per_grid_t is None else {"second_per_grid_ts": torch.tensor([second_per_grid_t] * 3)}
    theirs, their_delta = ref.model.get_rope_index(
        ids[None], mm_token_type_ids=(ids == img).int()[None], image_grid_thw=torch.tensor(grids), **kwargs
    )
    torch.testing.assert_close(ours, theirs[:, 0])
    assert delta == int(their_delta)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tower_on_gpu_projector_on_cpu(ckpt):
    # The window index transformers builds is a CPU tensor; the tower's activations are on the GPU. The reference is
    # the whole encoder on the GPU: this random checkpoint's attention is near one-hot, and the GPU's own float32
    # numerics (cuDNN's TF32 patch-embedding convolution, its SDPA kernels) move it far from the CPU (an H100).
    images = [make_image(w, h, seed=i) for i, (w, h) in enumerate(BATCH)]
    full = [e.cpu() for e in Qwen2_5_VLVisionEncoder(ckpt, device="cuda").encode(images)]
    split = EncoderRunner(
        ModelSpec.load(ckpt, device="cpu", dtype="float32"),
        EncoderArgs(vision_device="cuda", vision_dtype="float32", projector_device="cpu"),
    )
    for out, ref in zip(split.encoder.encode(images), full, strict=True):
        assert out.device.type == "cpu"
        torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-4)
