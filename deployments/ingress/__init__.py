"""The ingress process: everything only an Ingress replica runs, from the HTTP request to the streamed answer.

`server` (the deployment), `http` (keys, CORS, bodies, errors, SSE) and `client_json`, `info` (GET routes), `urls`
and `fetch` (image URLs), `prepare` (checks, each image's record and key, the sampling parameters), `prompt`,
`videos`, `generate` (the embedding cache's refs, the encoder calls, the choices), `detokenize`, `grounding`,
`responses` (chat), `text_completions`, `responses_api` and `messages_api`, `tokens` (/tokenize, /detokenize).
The LLM's and the Encoder's request routers run in this process too (Serve routes in the caller's handle), but their
code lives beside the deployment that declares each: `deployments.llm.router`, `deployments.encoder.router`."""

from deployments.ingress.server import Ingress

__all__ = ["Ingress"]
