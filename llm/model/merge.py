"""The one merge: image embeddings into the text embeddings at the placeholder positions."""

from __future__ import annotations

import torch


def merge_image_embeds(
    inputs_embeds: torch.Tensor, is_multimodal: torch.Tensor, image_embeds: torch.Tensor
) -> torch.Tensor:
    """inputs_embeds (T, D), is_multimodal (T,) bool on the CPU, image_embeds (N, D) -> (T, D)."""
    n_placeholders = int(is_multimodal.sum())  # counted on the CPU ids: no device sync
    if image_embeds.shape[0] != n_placeholders:
        raise ValueError(f"{image_embeds.shape[0]} image embeddings for {n_placeholders} placeholder tokens")
    if n_placeholders == 0:
        return inputs_embeds
    if image_embeds.shape[1] != inputs_embeds.shape[1]:
        raise ValueError(
            f"image embeddings have width {image_embeds.shape[1]}, the LM hidden size is {inputs_embeds.shape[1]}"
        )
    mask = is_multimodal.to(inputs_embeds.device, non_blocking=True).unsqueeze(-1)  # (T, 1)
    return inputs_embeds.masked_scatter(mask, image_embeds.to(inputs_embeds.device, inputs_embeds.dtype))


__all__ = ["merge_image_embeds"]
