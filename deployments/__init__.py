"""The app builder (`deployments.app:build_app`, run on the driver) and the ingress process (`deployments.ingress`).

The encoder and LLM replicas' deployments: `deployments.encoder.server`, `deployments.llm.server`."""

from typing import Any

__all__ = ["build_app"]


def __getattr__(name: str) -> Any:
    # NOTE: imported on first use: build_app imports every process's deployment, and the LLM's deployment imports
    # the ingress's request router (deployments.llm.router), so an eager import here would be a cycle.
    if name == "build_app":
        from deployments.app import build_app

        return build_app
    raise AttributeError(f"module 'deployments' has no attribute {name!r}")
