"""What each of our Serve replicas knows of itself: its id, and how often it looks whether its requests have ended
when it stops."""

from __future__ import annotations

from ray import serve

# How often a stopping replica of ours looks whether its requests have ended (Serve's default, 2 s): each deleted app,
# redeploy and scale-down waits at least one look, and a replica that had work two.
DRAIN_POLL_S = 0.5


def this_replica() -> str | None:
    """This Serve replica's unique id; None outside a replica (tests that build a deployment's class directly)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return None


__all__ = ["DRAIN_POLL_S", "this_replica"]
