"""`build_app(args)`: the application graph, Ingress -> (Encoder -> EmbeddingCache, LLM), from `args:`."""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from deployments.cache import EmbeddingCache
from deployments.encoder import Encoder
from deployments.ingress import Ingress
from deployments.llm import LLM
from schemas import AppArgs


def build_app(args: dict[str, Any]) -> Application:
    """Validated here, once, so a bad config fails at deploy time with the field named, not in a replica."""
    app_args = AppArgs.model_validate(args)
    plain = app_args.model_dump()
    cache = EmbeddingCache.bind(plain) if app_args.encoder.cache_gib > 0 else None
    return Ingress.bind(Encoder.bind(plain, cache), LLM.bind(plain), plain)
