"""The training-only targets of demo/train.py point where they should: coordinates are single tokens, the routed
head's keys are the image tokens of the shape asked about (in the right picture), pictures are numbered."""

from __future__ import annotations

import random

import pytest
import torch
from PIL import Image

from demo.batches import Encoder, sample_conversation
from demo.scenes import COLOURS, SHAPES, Shape
from demo.supervision import cell_cover, shape_cells, vision_targets
from demo.train import COORDS, AnswerLoss, build_tokenizer, make_config, quantize_box, save_checkpoint

COLOURS_LIST = list(COLOURS)
SMALL = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
             vision_embed_dim=32, vision_depth=1, vision_heads=2, vision_mlp_ratio=2)  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import Qwen2VLForConditionalGeneration

    tokenizer = build_tokenizer()
    config = make_config(tokenizer, **SMALL)
    out = tmp_path_factory.mktemp("shapes")
    save_checkpoint(Qwen2VLForConditionalGeneration(config), tokenizer, out, torch.float32)
    return tokenizer, config, Encoder(out, tokenizer, config.image_token_id)


def test_coordinates_are_single_tokens_and_answers_are_rounded(setup):
    tokenizer, _, _ = setup
    assert all(len(tokenizer.encode(c, add_special_tokens=False)) == 1 for c in COORDS)
    answer = "<|object_ref_start|>the red star<|object_ref_end|><|box_start|>(4,996),(123,455)<|box_end|>"
    assert (
        quantize_box(answer)
        == "<|object_ref_start|>the red star<|object_ref_end|><|box_start|>(0,990),(120,460)<|box_end|>"
    )
    assert quantize_box("3") == "3"  # a count is not a box


def test_cells_are_the_shape_s_by_what_it_covers():
    # A 280x140 picture in a 2x4 grid of 70 px cells; a square over the right half of the top row.
    square = Shape("red", "square", (140, 0, 280, 70))
    assert cell_cover(square, (280, 140), (2, 4)).round(3).tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert shape_cells(square, (280, 140), (2, 4)) == [2, 3]
    assert shape_cells(Shape("red", "square", (100, 10, 110, 20)), (280, 140), (2, 4)) == [1]  # tiny: the most covered
    targets = vision_targets(Image.new("RGB", (280, 140)), [square], (2, 4))
    assert targets[:, 0].tolist() == [8, 8, 0, 0, 8, 8, 8, 8] and targets[:, 9].tolist() == [
        -1,
        -1,
        0,
        0,
        -1,
        -1,
        -1,
        -1,
    ]
    # A triangle's box corners are background: a cell it covers in part is neither the shape's nor background.
    triangle = Shape("blue", "triangle", (0, 0, 140, 140))  # apex at (70, 0): the top cells are about 1/4 covered
    cover = cell_cover(triangle, (280, 140), (2, 4))
    colours = vision_targets(Image.new("RGB", (280, 140)), [triangle], (2, 4))[:, 0].tolist()
    assert 0.05 < cover[0] < 0.3 and colours[0] == -100 and colours[4] == list(COLOURS).index("blue")


def test_route_keys_are_the_image_tokens_of_the_shape_asked_about(setup):
    tokenizer, config, encoder = setup
    rng = random.Random(3)
    items = [sample_conversation(rng, 4, None, quantize_box) for _ in range(24)]
    assert any(len(it["images"]) == 2 for it in items)
    batch = encoder(items)
    ids, merge = batch["input_ids"], 2
    grids = iter([(h // merge, w // merge) for _, h, w in batch["image_grid_thw"].tolist()])
    for b, it in enumerate(items):
        image_pos = (ids[b] == config.image_token_id).nonzero().flatten().tolist()
        starts, these = [], []
        for _ in it["images"]:
            these.append(next(grids))
            starts.append(image_pos[sum(r * c for r, c in these[:-1])])
        # Each picture's tokens are numbered with its index, and nothing else is.
        assert (batch["pictures"][b] >= 0).sum() == len(image_pos)
        for p, (start, (r, c)) in enumerate(zip(starts, these)):
            assert set(batch["pictures"][b, start : start + r * c].tolist()) == {p}
        # Every query predicts an answer token, and looks only at image tokens of the shapes of its answer.
        queries = batch["route_queries"][b].nonzero().flatten()
        assert (batch["labels"][b, queries + 1] != -100).all()
        assert int(queries.numel()) == int((batch["labels"][b] != -100).sum())
        for q in queries.tolist():
            keys = batch["route_keys"][b, q].nonzero().flatten().tolist()
            assert keys and all(ids[b, k] == config.image_token_id for k in keys)
        first_answer_query = int(queries[0])
        _, _, focus = it["turns"][0]
        want = {starts[p] + cell for p, obj in focus for cell in shape_cells(obj, it["images"][p].size, these[p])}
        assert set(batch["route_keys"][b, first_answer_query].nonzero().flatten().tolist()) == want
        # The first layer's head is sent to the question's words that name the shape (none for a count).
        question = it["turns"][0][0]
        words = {" " + w.strip("?") for w in question.split()[1:]} & {f" {w}" for w in [*COLOURS, *SHAPES]}
        asked = batch["ask_keys"][b, first_answer_query].nonzero().flatten().tolist()
        assert {tokenizer.decode([int(ids[b, k])]) for k in asked} == words
        assert bool(batch["ask_queries"][b, first_answer_query]) == bool(words)
        # Where the answer is about one shape, the routed layer's probe is told that shape's colour, kind and box.
        assert bool(batch["read_queries"][b, first_answer_query]) == (len(focus) == 1)
        if len(focus) == 1:
            p, obj = focus[0]
            assert COLOURS_LIST[int(batch["read_colours"][b, first_answer_query])] == obj.colour
            assert SHAPES[int(batch["read_shapes"][b, first_answer_query])] == obj.shape
            w, h = it["images"][p].size
            assert batch["read_boxes"][b, first_answer_query].tolist() == pytest.approx(
                [obj.box[0] / w, obj.box[1] / h, obj.box[2] / w, obj.box[3] / h]
            )


def test_a_near_coordinate_costs_less_than_a_far_one(setup):
    tokenizer, config, _ = setup
    loss = AnswerLoss(tokenizer, config.text_config.vocab_size)
    vocab = config.text_config.vocab_size
    wanted = torch.stack([loss.coord_ids[26], loss.coord_ids[26], torch.tensor(tokenizer.convert_tokens_to_ids("red"))])
    logits = torch.full((3, vocab), -10.0)
    bins = torch.arange(len(COORDS), dtype=torch.float32)
    logits[0, loss.coord_ids] = -(bins - 25).abs()  # a guess around 250 for 260
    logits[1, loss.coord_ids] = -(bins - 80).abs()  # around 800
    logits[2, wanted[2]] = 10.0
    near, far, word = loss.token_losses(logits, wanted).tolist()
    assert near < far / 5 and word < 1e-3
