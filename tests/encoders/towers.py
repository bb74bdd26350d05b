"""A packed forward of our Qwen tower against transformers' `model.visual` on the same entries (images and videos)."""

from __future__ import annotations

import torch


def assert_matches_visual(ours: list[torch.Tensor], visual, batch: list, dtype: torch.dtype) -> None:
    """`ours`: our encoder's forward of `batch` (preprocessed entries); `visual`: transformers' vision tower of the same
    weights in `dtype`. fp32 within 1e-5; bf16 within torch's defaults for it."""
    pixel_values, grid_thw = torch.cat([pv for pv, _ in batch]), torch.tensor([g for _, g in batch])
    with torch.no_grad():  # get_image_features and get_video_features: this forward, split per entry
        theirs = visual(pixel_values.to(dtype), grid_thw=grid_thw).pooler_output
    assert [o.shape[0] for o in ours] == (grid_thw.prod(-1) // 4).tolist() and theirs.dtype == dtype
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}  # bf16: torch's defaults
    torch.testing.assert_close(torch.cat(ours), theirs, **tolerance)
