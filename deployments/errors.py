"""Ray's side of the errors that cross processes: which of Ray's errors mean that a replica went away (the work can
be done again elsewhere), the error a replica raised out of Ray's wrappers, and how Serve's logs show a client's
error. The errors themselves are plain data: schemas/errors.py."""

from __future__ import annotations

import logging

from ray.exceptions import (
    ActorUnavailableError,
    NodeDiedError,
    ObjectLostError,
    RayActorError,
    RayTaskError,
    TaskCancelledError,
    WorkerCrashedError,
)

from schemas import ChannelLost, InvalidRequest

# Errors that mean "the replica (or its node) that had this work went away", not "this request is bad": the
# work can be done again elsewhere (RayActorError covers ActorDiedError).
REPLICA_GONE: tuple[type[BaseException], ...] = (
    RayActorError,
    ActorUnavailableError,
    WorkerCrashedError,
    ObjectLostError,
    NodeDiedError,
)

# The ingress's LLM replica went away: the call's own stream says so (REPLICA_GONE), or the token channel that was to
# bring its chunks ended (ChannelLost); whichever of the two reaches the ingress first. Before the first token the
# generation goes once more; after it, or on the retry, a 503 `replica_lost`.
LLM_GONE: tuple[type[BaseException], ...] = (*REPLICA_GONE, ChannelLost)


def root_cause(e: BaseException) -> BaseException:
    """The error a replica raised, out of Ray's wrappers."""
    while isinstance(e, RayTaskError) and e.cause is not None and e.cause is not e:
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
        elif isinstance(exc, TaskCancelledError):
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


__all__ = ["LLM_GONE", "REPLICA_GONE", "quiet_client_errors", "root_cause"]
