"""The LLM replica's engine (`llm.engine`) and model (`llm.model`): token ids and image embeddings in, tokens out.
No Ray: the Serve deployment that runs it, its tensor-parallel rank actors, the embedding fetch and the token
channel are in `deployments.llm`."""

from llm.engine import Engine, EngineConfig
from llm.model import Qwen2LM, TextConfig, num_kv_blocks

__all__ = ["Engine", "EngineConfig", "Qwen2LM", "TextConfig", "num_kv_blocks"]
