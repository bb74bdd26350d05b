"""Prompt positions on the CPU: Qwen2-VL's 3-D M-RoPE from token ids and each image's patch grid, or plain 1-D
positions for LMs without M-RoPE (LLaVA's Llama)."""

from __future__ import annotations

import torch


def mrope_positions(
    input_ids: torch.Tensor,
    image_token_id: int,
    image_grid_thw: list[tuple[int, int, int]],
    merge_size: int,
    *,
    video_token_id: int | None = None,
    time_intervals: list[float | None] | None = None,
) -> tuple[torch.Tensor, int]:
    """input_ids (T,) -> positions (3, T) and the rope delta (decode position = cache length + delta).

    Text advances all three axes together; an image's (or video's) tokens take (t, row, col) offsets from the
    position where it starts, and the text after it continues from that position + max(rows, cols) of merged
    patches (transformers' get_rope_index of the pinned 5.23; the Qwen2-VL paper's and the original Qwen code's
    rule is the item's largest position + 1, which differs for a video with more tubelets than rows and columns).
    A video's temporal offset of tubelet i is int(i * interval): `time_intervals` per item, None or absent: 1
    (Qwen2-VL's arange(t); an image has t = 1); Qwen2.5-VL's is tokens_per_second * second_per_grid_t, multiplied
    before the truncation. Placeholders are `image_token_id` and `video_token_id`, items in prompt order, each
    one contiguous, complete run (never a part of an item).
    """
    # Adapted from get_rope_index and get_vision_position_ids in transformers/models/qwen2_vl/modeling_qwen2_vl.py.
    T = input_ids.shape[0]
    is_placeholder = input_ids == image_token_id
    if video_token_id is not None:
        is_placeholder |= input_ids == video_token_id
    placeholder_idx = is_placeholder.nonzero().flatten().tolist()
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
        interval = time_intervals[i] if time_intervals else None
        # NOTE: in float32, as transformers multiplies arange(t) by a float32 second_per_grid_ts tensor
        temporal = torch.arange(t) if interval is None else (torch.arange(t) * _f32(interval)).long()
        grid = torch.stack(torch.meshgrid(temporal, torch.arange(gh), torch.arange(gw), indexing="ij"))
        positions[:, s : s + n] = grid.reshape(3, n) + next_pos  # (3, n)
        next_pos += max(gh, gw)
        cursor, k = s + n, k + n
    if k != len(placeholder_idx):
        raise ValueError(f"{len(placeholder_idx)} placeholder tokens for {k} image embedding rows")
    positions[:, cursor:] = torch.arange(next_pos, next_pos + T - cursor)
    rope_delta = int(positions.max()) + 1 - T if T else 0
    return positions, rope_delta


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def video_time_interval(second_per_grid_t: float, tokens_per_second: float | None) -> float | None:
    """Qwen2.5-VL's temporal step per tubelet (its vision config's tokens_per_second times the video's seconds per
    tubelet, in float32 as transformers computes it); None (a step of 1) for Qwen2-VL, which has none."""
    if tokens_per_second is None:
        return None
    return float(tokens_per_second * _f32(second_per_grid_t))


def linear_positions(input_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """input_ids (T,) -> positions (3, T), all three rows 0..T-1 (a 1-D RoPE reads the first), rope delta 0."""
    return torch.arange(input_ids.shape[0]).expand(3, -1), 0  # (3, T)


__all__ = ["linear_positions", "mrope_positions", "video_time_interval"]
