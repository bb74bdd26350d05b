"""Errors that cross component boundaries; only the ingress turns them into HTTP responses. (Which of Ray's errors mean
a replica went away, and how Serve's logs show a client's error: deployments/errors.py.)"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """The client's fault: the ingress answers 4xx with this message (400 unless `status` says otherwise)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def __reduce__(self):  # NOTE: keeps the fields when Ray pickles the error across processes.
        return (type(self), (self.message, self.param, self.code, self.status))


class Overloaded(RuntimeError):
    """No capacity now: the ingress answers 503 with Retry-After."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.message, self.retry_after_s = message, retry_after_s

    def __reduce__(self):
        return (type(self), (self.message, self.retry_after_s))


class EncoderUnavailable(RuntimeError):
    """What these encoder calls made could not be had (their replica died, or they timed out): `calls` are their
    indices among the ObjectRefs the ingress sent with the request, whose images it encodes once more."""

    def __init__(self, message: str, calls: list[int]):
        super().__init__(message)
        self.message, self.calls = message, calls

    def __reduce__(self):
        return (type(self), (self.message, self.calls))


class ChannelLost(Overloaded):
    def __init__(self, replica_id: str):
        super().__init__(f"the token channel to LLM replica {replica_id} closed", retry_after_s=1)
        self.replica_id = replica_id

    def __reduce__(self):  # NOTE: Overloaded's fields are not this constructor's arguments
        return (type(self), (self.replica_id,))


def observe(future) -> None:
    """A done-callback: marks a future's exception as seen (it may fail after nobody awaits it any more)."""
    if not future.cancelled():
        future.exception()


__all__ = ["ChannelLost", "EncoderUnavailable", "InvalidRequest", "Overloaded", "observe"]
