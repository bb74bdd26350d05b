"""The Encoder process's Serve pieces: `server` (the Encoder deployment, a thin shim over `encoders.EncoderRunner`),
`router` (its request router, `CostRouter`, which runs in the callers' handles: the ingress replicas) and
`autoscaling` (its cost policy, which Serve's controller runs). The deployment is not imported here: an ingress
replica imports this package for the router alone."""

from deployments.encoder.router import CostRouter

__all__ = ["CostRouter"]
