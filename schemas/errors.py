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
    """Embeddings of these images could not be had (their replica died, or timed out): the ingress retries them."""

    def __init__(self, message: str, image_indices: list[int]):
        super().__init__(message)
        self.message, self.image_indices = message, image_indices

    def __reduce__(self):
        return (type(self), (self.message, self.image_indices))


class ChannelLost(Overloaded):
    def __init__(self, replica_id: str):
        super().__init__(f"the token channel to LLM replica {replica_id} closed", retry_after_s=1)


def root_cause(e: BaseException) -> BaseException:
    """The error a replica raised, out of Ray's wrappers."""
    while RayTaskError is not None and isinstance(e, RayTaskError) and e.cause is not None and e.cause is not e:
        e = e.cause
    return e


class _ClientErrorsAsWarnings(logging.Filter):
    """Serve logs every exception a replica's method raises as an ERROR with its traceback ("Request failed.").
    A client's error (an image that does not decode, found by the Encoder) is not ours: one WARNING line with its
    message instead. Serve's line format adds the request id."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = root_cause(record.exc_info[1]) if record.exc_info and record.exc_info[1] is not None else None
        if isinstance(exc, InvalidRequest):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = f"Request failed: the client's error ({exc.status}): {exc.message}", ()
            record.exc_info, record.exc_text = None, None
        return True


class _DisconnectsAsInfo(logging.Filter):
    """When a client closes its connection mid-response, Serve's HTTP entrypoint leaves a task failed with
    TaskCancelledError that nobody awaits; asyncio logs it as an ERROR traceback ("Task exception was never
    retrieved"). A client leaving is not an error here: one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if TaskCancelledError is not None and isinstance(exc, TaskCancelledError):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = "a client closed its connection mid-response (%s)", (str(exc),)
            record.exc_info, record.exc_text = None, None
        return True


def quiet_client_errors(logger_name: str = "ray.serve") -> None:
    """The two filters above, on Serve's logger and asyncio's (each replica calls it at start; twice is once)."""
    for name, kind in ((logger_name, _ClientErrorsAsWarnings), ("asyncio", _DisconnectsAsInfo)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())


def observe(future) -> None:
    """A done-callback: marks a future's exception as seen (it may fail after nobody awaits it any more)."""
    if not future.cancelled():
        future.exception()


__all__ = [
    "REPLICA_GONE",
    "ChannelLost",
    "EncoderUnavailable",
    "InvalidRequest",
    "Overloaded",
    "observe",
    "quiet_client_errors",
    "root_cause",
]
