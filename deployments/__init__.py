"""Thin Ray Serve shims: the ingress, encoder and LLM deployments, and `build_app`."""

from deployments.app import build_app
from deployments.cache import EmbeddingCache
from deployments.encoder import Encoder
from deployments.ingress import Ingress
from deployments.llm import LLM

__all__ = ["EmbeddingCache", "Encoder", "Ingress", "LLM", "build_app"]
