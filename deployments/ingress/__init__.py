"""The ingress process: everything only an Ingress replica runs, from the HTTP request to the streamed answer.

`server` (the deployment), `http`, `auth`, `urls` and `fetch` (image URLs), `prepare` (checks, prompt, image
fan-out), `sampling` (the engine's parameters), `prompt`, `generate` (encodes, starts the choices), `detokenize`,
`grounding`, `responses` (chat) and `text_completions`, `tokens` (/tokenize, /detokenize), `channel` (the ingress
half of the token channel). The LLM's and the Encoder's request routers run in this process too (Serve routes in
the caller's handle), but their code lives beside the deployment that declares each: `deployments.llm.router`,
`deployments.encoder.router`."""

from deployments.ingress.server import Ingress

__all__ = ["Ingress"]
