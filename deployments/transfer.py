"""Embeddings cross Ray without being copied: a torch tensor is pickled as a numpy array, whose buffer pickle
protocol 5 carries out of band, so the receiver maps it from the object store instead of unpickling a copy.

Ray pickles torch tensors in band by default (`make bench-encoder`: a 25 MB embedding took 75-210 ms from encoder
to LLM, against about 6 ms out of band). Ray's own switch for this, RAY_ENABLE_ZERO_COPY_TORCH_TENSORS, is an
environment variable of the worker; registering the reducer here keeps it with the code that needs it.

A module of its own, and a light one (torch, numpy, Ray): a receiver (the LLM replica) imports it to unpickle an
embedding, since the pickle names `_from_numpy` by its module; beside the Encoder deployment it would bring that
deployment's imports into every receiver."""

from __future__ import annotations

import warnings

import numpy as np
import ray
import torch


def _to_numpy(tensor: torch.Tensor) -> tuple[str, np.ndarray]:
    t = tensor.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: send the bits
        return "bfloat16", t.view(torch.int16).numpy()
    return "", t.numpy()


def _from_numpy(payload: tuple[str, np.ndarray]) -> torch.Tensor:
    dtype, array = payload
    with warnings.catch_warnings():  # read-only: the buffer is the object store's; receivers only read it
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def send_tensors_out_of_band() -> None:
    """For tensors this process serializes (returns, and arguments it passes); any process can deserialize them."""
    ray.util.register_serializer(torch.Tensor, serializer=_to_numpy, deserializer=_from_numpy)


__all__ = ["send_tensors_out_of_band"]
