"""The Encoder process's Serve pieces: `server` (the Encoder deployment, a thin shim over `encoders.EncoderRunner`),
`router` (its request router, `CostRouter`, which runs in the callers' handles: the ingress replicas) and
`autoscaling` (its cost policy, which Serve's controller runs). The deployment is not imported here: an ingress
replica imports this package for the router alone."""

import time

# The first line of ours a new Encoder replica runs (Serve imports this package, then the deployment's module): its
# start's `imports` phase is timed from here (deployments/replica.py's StartTimeline).
IMPORTS_BEGAN = time.time()

from deployments.encoder.router import CostRouter  # noqa: E402

__all__ = ["CostRouter"]
