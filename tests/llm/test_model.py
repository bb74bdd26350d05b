"""Our decoder against transformers' Qwen2-VL on the same weights: logits, both checkpoint layouts, weights held."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from demo.inputs import make_image
from encoders import Qwen2VLVisionEncoder
from llm import Qwen2LM
from llm.model import BatchMeta, ChunkSpec, cpu_kernels, merge_image_embeds, mrope_positions
from llm.model.model import fuse_projections


def run_chunks(model: Qwen2LM, embeds, positions, cuts: list[int], block_size: int = 4):
    """Prefill one sequence in chunks [0, c1), [c1, c2), ... through the paged cache; hidden states (T, D)."""
    T = embeds.shape[0]
    cache = model.new_cache(-(-T // block_size) + 1, block_size)
    blocks = list(range(cache.num_blocks))[::-1]  # deliberately not in order
    out, bounds = [], [0, *cuts, T]
    for a, b in zip(bounds, bounds[1:]):
        meta = BatchMeta.build([ChunkSpec(blocks, a, b - a)], block_size, embeds.device)
        out.append(model(embeds[a:b], positions[:, a:b], cache, meta))
    return torch.cat(out)


def _prompt_with_images(reference, checkpoint, sizes):
    """Token ids with one placeholder run per image, plus transformers' own pixel inputs for them."""
    cfg = reference.config
    images = [make_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    processed = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)(images=images, return_tensors="pt")
    ids = [3, 4, 5]
    for grid in processed["image_grid_thw"].tolist():
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (grid[0] * grid[1] * grid[2] // 4)
        ids += [cfg.vision_end_token_id, 6, 7]
    return torch.tensor(ids), images, processed


@pytest.mark.parametrize("ops", ["cpu kernels", "torch ops"])
def test_prefill_logits_match_transformers(checkpoint, reference, ops, monkeypatch):
    """Both ways the layers run: model/cpu_kernels.cpp's fused ops, and torch's (cuda's, or CPU without a compiler)."""
    assert cpu_kernels.load() is not None
    if ops == "torch ops":
        monkeypatch.setattr(cpu_kernels, "_module", None)
    ids, images, processed = _prompt_with_images(reference, checkpoint, [(57, 31), (200, 90)])
    image_token_id = reference.config.image_token_id
    with torch.no_grad():
        ref = reference(
            input_ids=ids[None],
            pixel_values=processed["pixel_values"],
            image_grid_thw=processed["image_grid_thw"],
            mm_token_type_ids=(ids == image_token_id).int()[None],
        ).logits[0]
    model = Qwen2LM.from_pretrained(checkpoint)
    embeds = Qwen2VLVisionEncoder(checkpoint).encode(images)
    grids = [tuple(g) for g in processed["image_grid_thw"].tolist()]
    positions, _ = mrope_positions(ids, image_token_id, grids, merge_size=2)
    with torch.no_grad():
        x = merge_image_embeds(model.embed(ids), ids == image_token_id, torch.cat(embeds))
        ours = model.logits(run_chunks(model, x, positions, []))
    # NOTE: fused projections and the complex RoPE round differently from transformers' separate ops: float32
    # noise of a few 1e-5 of the logits' scale (std ~8 here); the argmax below must not move.
    torch.testing.assert_close(ours, ref, atol=5e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_chunked_prefill_equals_one_prefill(checkpoint):
    model = Qwen2LM.from_pretrained(checkpoint)
    ids = torch.arange(3, 40)
    positions = torch.arange(len(ids)).expand(3, -1)
    with torch.no_grad():
        whole = run_chunks(model, model.embed(ids), positions, [])
        parts = run_chunks(model, model.embed(ids), positions, [10, 11, 13, 30])  # decode-sized chunks too
    torch.testing.assert_close(parts, whole, atol=1e-4, rtol=1e-4)


def test_both_layouts_load_the_same_language_model(checkpoint, legacy_checkpoint, reference):
    hub, legacy = (
        Qwen2LM.from_pretrained(checkpoint).state_dict(),
        Qwen2LM.from_pretrained(legacy_checkpoint).state_dict(),
    )
    assert hub.keys() == legacy.keys()
    for name in hub:
        assert torch.equal(hub[name], legacy[name]), name
    ref = {f"{k}": v for k, v in reference.model.language_model.state_dict().items()}
    ref["lm_head.weight"] = reference.lm_head.weight
    c = reference.config.text_config
    ref = fuse_projections(ref, c.num_hidden_layers, c.hidden_size // c.num_attention_heads)  # our fused layout
    assert set(hub) == set(ref)  # the language model, its embeddings and lm_head; no vision weights
    for name, tensor in hub.items():
        assert torch.equal(tensor, ref[name]), name
