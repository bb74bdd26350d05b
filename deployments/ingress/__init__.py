"""The ingress process: everything only an Ingress replica runs, from the HTTP request to the streamed answer.

`server` (the deployment), `http`, `auth`, `urls` and `fetch` (image URLs), `prepare` (checks, prompt, image
fan-out), `sampling` (the engine's parameters), `prompt`, `generate` (encodes, starts the choices), `detokenize`,
`grounding`, `responses` (chat) and `text_completions`, `tokens` (/tokenize, /detokenize), `channel` (the ingress
half of the token channel), `router` (the LLM's request router, which runs in the caller's handle, so here). The
Encoder's request router runs here too, beside the deployment that declares it: `deployments.encoder.router`."""

from deployments.ingress.router import PrefixAffinityRouter
from deployments.ingress.server import Ingress

__all__ = ["Ingress", "PrefixAffinityRouter"]
