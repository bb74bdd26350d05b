"""The language model: the Qwen2 / Llama decoder (`model`, `layers`), the paged KV cache and attention over it
(`attention`, with its Triton and C++ kernels), tensor parallelism, the image merge and RoPE positions."""

from llm.model.attention import BatchMeta, ChunkSpec, KVCache, num_kv_blocks, paged_attention
from llm.model.model import Qwen2LM, TextConfig, linear_positions, merge_image_embeds, mrope_positions

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
