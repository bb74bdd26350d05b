"""The language-model side: weights, decoder, KV cache, engine, sampling, the merge, positions, prompt text."""

from llm.detokenize import IncrementalDetokenizer, StopMatcher
from llm.engine import Engine, SequenceInput
from llm.kv_cache import KVCache
from llm.merge import merge_image_embeds
from llm.model import Qwen2LM, TextConfig
from llm.positions import mrope_positions
from llm.prompt import build_prompt, load_tokenizer, template_messages
from llm.sampling import make_generator, sample

__all__ = [
    "Engine",
    "IncrementalDetokenizer",
    "KVCache",
    "Qwen2LM",
    "SequenceInput",
    "StopMatcher",
    "TextConfig",
    "build_prompt",
    "load_tokenizer",
    "make_generator",
    "merge_image_embeds",
    "mrope_positions",
    "sample",
    "template_messages",
]
