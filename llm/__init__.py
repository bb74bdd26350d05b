"""The LLM replica: its Serve deployment (`llm.server:LLM`), the tensor-parallel rank actors (`llm.tp`), its half of
the token channel (`llm.channel`), the engine (`llm.engine`) and the model (`llm.model`).

The deployment is not imported here: the engine and the model load without Ray Serve."""

from llm.engine import Engine, EngineConfig
from llm.model import Qwen2LM, TextConfig, num_kv_blocks

__all__ = ["Engine", "EngineConfig", "Qwen2LM", "TextConfig", "num_kv_blocks"]
