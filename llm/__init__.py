"""The language-model side: weights, decoder, KV cache, engine, sampling, the merge, positions, prompt text."""

from llm.detokenize import IncrementalDetokenizer, OutputProcessor, StopMatcher, TextDelta
from llm.attention import BatchMeta, ChunkSpec, paged_attention
from llm.block_pool import BlockPool, block_hash
from llm.engine import Engine, EngineConfig
from llm.model_runner import ModelRunner, Sampled
from llm.grounding import GroundingTokens, parse_boxes
from llm.kv_cache import KVCache, num_kv_blocks
from llm.merge import merge_image_embeds
from llm.model import Qwen2LM, TextConfig
from llm.positions import linear_positions, mrope_positions
from llm.prompt import build_prompt, load_tokenizer, template_messages
from llm.sampling import make_generator, sample
from llm.scheduler import Chunk, Scheduler
from llm.sequence import Sequence, SequenceInput, make_sequence

__all__ = [
    "BatchMeta",
    "BlockPool",
    "Chunk",
    "ChunkSpec",
    "Engine",
    "EngineConfig",
    "GroundingTokens",
    "IncrementalDetokenizer",
    "KVCache",
    "ModelRunner",
    "OutputProcessor",
    "Qwen2LM",
    "Sampled",
    "Scheduler",
    "Sequence",
    "SequenceInput",
    "StopMatcher",
    "TextConfig",
    "TextDelta",
    "block_hash",
    "build_prompt",
    "load_tokenizer",
    "make_sequence",
    "make_generator",
    "merge_image_embeds",
    "linear_positions",
    "mrope_positions",
    "num_kv_blocks",
    "paged_attention",
    "parse_boxes",
    "sample",
    "template_messages",
]
