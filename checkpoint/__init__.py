"""The checkpoint's safetensors, read by component: which keys hold the vision tower, the language model and lm_head,
in every layout of a family, and only those tensors read (or only a tensor-parallel rank's slices of them). Below both
`encoders` and `llm`, which each load their own weights with it; the checkpoint's other facts (its config, family,
token ids, context) are `encoders.ModelSpec`."""

from checkpoint.weights import Component, Index, load_components, split_key

__all__ = ["Component", "Index", "load_components", "split_key"]
