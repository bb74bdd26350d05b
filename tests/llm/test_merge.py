"""The one merge: image embeddings land exactly on the placeholder positions, counts must agree."""

from __future__ import annotations

import pytest
import torch

from llm.model import merge_image_embeds


def test_embeddings_land_at_placeholder_positions():
    T, D, image_token_id = 10, 4, 7
    input_ids = torch.tensor([1, 7, 7, 2, 3, 7, 7, 7, 4, 5])
    text = torch.arange(T * D, dtype=torch.float32).view(T, D)
    images = -torch.arange(1, 5 * D + 1, dtype=torch.float32).view(5, D)
    merged = merge_image_embeds(text, input_ids == image_token_id, images)
    placeholder = (input_ids == image_token_id).nonzero().flatten().tolist()
    assert placeholder == [1, 2, 5, 6, 7]
    torch.testing.assert_close(merged[placeholder], images)  # in order, row by row
    others = [i for i in range(T) if i not in placeholder]
    torch.testing.assert_close(merged[others], text[others])  # text untouched


def test_count_mismatch_names_both_numbers():
    is_mm = torch.tensor([False, True, True, True, False])
    with pytest.raises(ValueError, match="2 image embeddings for 3 placeholder tokens"):
        merge_image_embeds(torch.zeros(5, 4), is_mm, torch.ones(2, 4))
    with pytest.raises(ValueError, match="4 image embeddings for 3 placeholder tokens"):
        merge_image_embeds(torch.zeros(5, 4), is_mm, torch.ones(4, 4))


def test_width_mismatch_is_an_error():
    with pytest.raises(ValueError, match="width 8"):
        merge_image_embeds(torch.zeros(3, 4), torch.tensor([True, False, False]), torch.ones(1, 8))


def test_text_only_is_unchanged():
    text = torch.randn(4, 3)
    assert merge_image_embeds(text, torch.zeros(4, dtype=torch.bool), torch.empty(0, 3)) is text
