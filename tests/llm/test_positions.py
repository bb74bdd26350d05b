"""M-RoPE positions against transformers' get_rope_index, and the image-run checks."""

from __future__ import annotations

import pytest
import torch

from llm.model import mrope_positions

IMG = 9


def _ids(*runs: tuple[str, int]) -> torch.Tensor:
    ids = []
    for kind, n in runs:
        ids += [IMG] * n if kind == "img" else list(range(1, n + 1))
    return torch.tensor(ids)


def test_matches_get_rope_index(reference):
    # Three images of different grids, text between and after, image at the very start too.
    grids = [(1, 4, 6), (1, 2, 2), (1, 8, 2)]
    ids = _ids(("img", 6), ("txt", 3), ("img", 1), ("txt", 5), ("img", 4), ("txt", 2))
    ours, delta = mrope_positions(ids, IMG, grids, merge_size=2)
    ref_ids = ids.clone()
    ref_ids[ids == IMG] = reference.config.image_token_id
    ref, ref_delta = reference.model.get_rope_index(
        ref_ids[None], mm_token_type_ids=(ids == IMG).int()[None], image_grid_thw=torch.tensor(grids)
    )
    torch.testing.assert_close(ours, ref[:, 0])
    assert delta == int(ref_delta)


def test_text_after_image_continues_from_max_plus_one():
    ids = _ids(("txt", 2), ("img", 6), ("txt", 2))
    pos, delta = mrope_positions(ids, IMG, [(1, 4, 6)], merge_size=2)  # 2x3 merged grid
    assert pos[:, :2].tolist() == [[0, 1]] * 3
    assert pos[0, 2:8].tolist() == [2] * 6  # time
    assert pos[1, 2:8].tolist() == [2, 2, 2, 3, 3, 3]  # rows
    assert pos[2, 2:8].tolist() == [2, 3, 4, 2, 3, 4]  # columns
    assert pos[:, 8].tolist() == [5, 5, 5]  # max (4) + 1
    assert delta == int(pos.max()) + 1 - len(ids) == -3


def test_text_only_is_plain_arange():
    pos, delta = mrope_positions(torch.arange(1, 6), IMG, [], merge_size=2)
    assert pos.tolist() == [list(range(5))] * 3 and delta == 0


def test_a_split_image_is_rejected():
    ids = _ids(("img", 3), ("txt", 1), ("img", 3))
    with pytest.raises(ValueError, match="not one contiguous run"):
        mrope_positions(ids, IMG, [(1, 4, 6)], merge_size=2)


@pytest.mark.parametrize(
    ("n_placeholders", "fragment"),
    [(5, "needs 6 placeholder tokens, 5 are left"), (7, "7 placeholder tokens for 6 image embedding rows")],
)
def test_incomplete_or_extra_placeholders_are_rejected(n_placeholders, fragment):
    ids = _ids(("txt", 2), ("img", n_placeholders), ("txt", 2))
    with pytest.raises(ValueError, match=fragment):
        mrope_positions(ids, IMG, [(1, 4, 6)], merge_size=2)
