"""The ingress process: everything only an Ingress replica runs, from the HTTP request to the streamed answer.

`server` (the deployment), `http`, `auth`, `urls` and `fetch` (image URLs), `prepare` (checks, prompt, image
fan-out), `sampling` (the engine's parameters), `prompt`, `generate` (encodes, starts the choices), `detokenize`,
`grounding`, `responses` (chat) and `text_completions`, `tokens` (/tokenize, /detokenize), `channel` (the ingress
half of the token channel), `router` and `encoder_router` (the LLM's and the Encoder's request routers, which run in
the caller's handle, so here)."""

from deployments.ingress.encoder_router import CostRouter
from deployments.ingress.router import PrefixAffinityRouter
from deployments.ingress.server import Ingress

__all__ = ["CostRouter", "Ingress", "PrefixAffinityRouter"]
