"""The LLM process's Serve pieces: `server` (the LLM deployment, a thin shim over `llm.Engine`), `router` (its request
router, `PrefixAffinityRouter`, which runs in the callers' handles: the ingress replicas), `tp` (the tensor-parallel
rank actors and their placement), `images` (the embeddings fetched from their ObjectRefs) and `channel` (the LLM
half of the token channel). The deployment is not imported here: an ingress replica imports this package for the
router alone, and must not load the engine."""

from deployments.llm.router import PrefixAffinityRouter

__all__ = ["PrefixAffinityRouter"]
