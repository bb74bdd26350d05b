"""The language model: the Qwen2 / Llama decoder (`model`, `layers`), paged attention (`attention`, with its Triton
and C++ kernels), the KV cache tensors, tensor parallelism, the image merge and RoPE positions."""

from llm.model.attention import BatchMeta, ChunkSpec, paged_attention
from llm.model.kv_cache import KVCache, num_kv_blocks
from llm.model.model import Qwen2LM, TextConfig, merge_image_embeds
from llm.model.positions import linear_positions, mrope_positions

__all__ = [
    "BatchMeta",
    "ChunkSpec",
    "KVCache",
    "Qwen2LM",
    "TextConfig",
    "linear_positions",
    "merge_image_embeds",
    "mrope_positions",
    "num_kv_blocks",
    "paged_attention",
]
