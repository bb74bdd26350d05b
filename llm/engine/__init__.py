"""The engine (nano-vllm's seams): `engine` (requests in, chunks out, the loop), `scheduler` (which tokens run this
step), `block_pool` (KV blocks and prefix reuse), `sequence` (one request's state), `model_runner` (a step's inputs,
the forward, sampling; `decode_step` is its static decode path)."""

from llm.engine.block_pool import BlockPool, block_hash
from llm.engine.engine import Engine, EngineConfig
from llm.engine.model_runner import ModelRunner, Sampled
from llm.engine.sampling import make_generator, sample
from llm.engine.scheduler import Chunk, Scheduler
from llm.engine.sequence import Sequence, make_sequence

__all__ = [
    "BlockPool",
    "Chunk",
    "Engine",
    "EngineConfig",
    "ModelRunner",
    "Sampled",
    "Scheduler",
    "Sequence",
    "block_hash",
    "make_generator",
    "make_sequence",
    "sample",
]
