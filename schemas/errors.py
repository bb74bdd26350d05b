"""Errors that cross component boundaries; only the ingress turns them into HTTP responses."""

from __future__ import annotations

import logging

try:
    from ray.exceptions import (
        ActorUnavailableError,
        NodeDiedError,
        ObjectLostError,
        RayActorError,
        RayTaskError,
        TaskCancelledError,
        WorkerCrashedError,
    )

    # Errors that mean "the replica (or its node) that had this work went away", not "this request is bad": the
    # work can be done again elsewhere (RayActorError covers ActorDiedError).
    REPLICA_GONE: tuple[type[BaseException], ...] = (
        RayActorError,
        ActorUnavailableError,
        WorkerCrashedError,
        ObjectLostError,
        NodeDiedError,
    )
except ImportError:  # NOTE: the engine runs without Ray too (bench/gpu_decode.py on a bare GPU machine): no replica
    RayTaskError = None  # to lose, no wrapper to unwrap.
    REPLICA_GONE = ()
    TaskCancelledError = None


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


# The ingress's LLM replica went away: the call's own stream says so (REPLICA_GONE), or the token channel that was to
# bring its chunks ended (ChannelLost); whichever of the two reaches the ingress first. Before the first token the
# generation goes once more; after it, or on the retry, a 503 `replica_lost`.
LLM_GONE: tuple[type[BaseException], ...] = (*REPLICA_GONE, ChannelLost)


def root_cause(e: BaseException) -> BaseException:
    """The error a replica raised, out of Ray's wrappers."""
    while RayTaskError is not None and isinstance(e, RayTaskError) and e.cause is not None and e.cause is not e:
        e = e.cause
    return e


class _ClientsNotOurs(logging.Filter):
    """What a client did is not our error, however Serve or asyncio log it.
    - Serve logs every exception a replica's method raises as an ERROR with its traceback ("Request failed."). A
      client's error (an image that does not decode, found by the Encoder) becomes one WARNING line with its message
      (Serve's line format adds the request id).
    - A client that closes its connection mid-response leaves Serve's HTTP entrypoint failed with TaskCancelledError:
      Serve logs it as "Request failed.", asyncio as "Task exception was never retrieved", both ERROR tracebacks. It
      becomes one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = root_cause(record.exc_info[1]) if record.exc_info and record.exc_info[1] is not None else None
        if isinstance(exc, InvalidRequest):
            level, record.msg, record.args = (
                logging.WARNING,
                "Request failed: the client's error (%d): %s",
                (exc.status, exc.message),
            )
        elif TaskCancelledError is not None and isinstance(exc, TaskCancelledError):
            level, record.msg, record.args = logging.INFO, "a client closed its connection mid-response (%s)", (exc,)
        else:
            return True
        record.levelno, record.levelname = level, logging.getLevelName(level)
        record.exc_info, record.exc_text = None, None
        return True


def quiet_client_errors(logger_name: str = "ray.serve") -> None:
    """`_ClientsNotOurs` on Serve's logger and asyncio's (each replica calls it at start; twice is once)."""
    for name in (logger_name, "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ClientsNotOurs) for f in logger.filters):
            logger.addFilter(_ClientsNotOurs())


def observe(future) -> None:
    """A done-callback: marks a future's exception as seen (it may fail after nobody awaits it any more)."""
    if not future.cancelled():
        future.exception()


__all__ = [
    "LLM_GONE",
    "REPLICA_GONE",
    "ChannelLost",
    "EncoderUnavailable",
    "InvalidRequest",
    "Overloaded",
    "observe",
    "quiet_client_errors",
    "root_cause",
]
