"""Every Ray Serve piece, one folder a process: `app` (`build_app`, run on the driver: serve_config.yaml's
`deployments.app:build_app`), `ingress/`, `encoder/` and `llm/` (each process's deployment, a thin shim over the
model code in `encoders` and `llm`, and the request router it declares), with what they share: `channel` (the token
channel, both ends), `errors` (Ray's), `ray_private`, `replica`, `metrics` and `transfer` (embeddings out of band).

Nothing is imported here: a replica imports its own deployment's module, and `build_app` would bring every process's
code into each (the LLM's engine into the ingress)."""
