"""Prompt positions on the CPU: Qwen2-VL's 3-D M-RoPE from token ids and each image's patch grid, or plain 1-D
positions for LMs without M-RoPE (LLaVA's Llama)."""

from __future__ import annotations

import torch


def mrope_positions(
    input_ids: torch.Tensor, image_token_id: int, image_grid_thw: list[tuple[int, int, int]], merge_size: int
) -> tuple[torch.Tensor, int]:
    """input_ids (T,) -> positions (3, T) and the rope delta (decode position = cache length + delta).

    Text advances all three axes together; an image's tokens take (t, row, col) offsets from the position where
    it starts, and the text after it continues from the image's largest position + 1.
    Each image must own one contiguous, complete run of placeholders (never a part of an image).
    """
    # Adapted from get_rope_index in transformers/models/qwen2_vl/modeling_qwen2_vl.py.
    T = input_ids.shape[0]
    placeholder_idx = (input_ids == image_token_id).nonzero().flatten().tolist()
    positions = torch.empty(3, T, dtype=torch.long)
    cursor = next_pos = k = 0
    for i, (t, h, w) in enumerate(image_grid_thw):
        gh, gw = h // merge_size, w // merge_size
        n = t * gh * gw
        if k + n > len(placeholder_idx):
            raise ValueError(f"image {i} needs {n} placeholder tokens, {len(placeholder_idx) - k} are left")
        s = placeholder_idx[k]
        if placeholder_idx[k + n - 1] != s + n - 1:
            raise ValueError(f"the {n} placeholder tokens of image {i} are not one contiguous run")
        positions[:, cursor:s] = torch.arange(next_pos, next_pos + s - cursor)
        next_pos += s - cursor
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"))
        positions[:, s : s + n] = grid.reshape(3, n) + next_pos  # (3, n)
        next_pos += max(gh, gw)
        cursor, k = s + n, k + n
    if k != len(placeholder_idx):
        raise ValueError(f"{len(placeholder_idx)} placeholder tokens for {k} image embedding rows")
    positions[:, cursor:] = torch.arange(next_pos, next_pos + T - cursor)
    rope_delta = int(positions.max()) + 1 - T if T else 0
    return positions, rope_delta


def linear_positions(input_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """input_ids (T,) -> positions (3, T), all three rows 0..T-1 (a 1-D RoPE reads the first), rope delta 0."""
    return torch.arange(input_ids.shape[0]).expand(3, -1), 0  # (3, T)


__all__ = ["linear_positions", "mrope_positions"]
