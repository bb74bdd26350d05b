"""Ray's side of the errors that cross processes: which of Ray's errors mean that a replica went away (the work can
be done again elsewhere), the error a replica raised out of Ray's wrappers, and how Serve's logs show a client's
error. The errors themselves are plain data: schemas/errors.py."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

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


def _install(kind: type[logging.Filter], *logger_names: str) -> None:
    """A `kind` filter on each of these loggers, unless it has one (twice is once)."""
    for name in logger_names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())


def quiet_client_errors(logger_name: str = "ray.serve") -> None:
    """`_ClientsNotOurs` on Serve's logger and asyncio's (each replica calls it at start)."""
    _install(_ClientsNotOurs, logger_name, "asyncio")


PROBE_TIMEOUT = "Failed to get queue length from "  # how Serve's router words a probe that timed out (Ray 2.60)
PROBE_LOG_EVERY_S = 60.0


class _ProbeTimeouts(logging.Filter):
    """Serve's request router (it runs in the callers: the ingress replicas) asks a replica its queue length before
    sending it a call, when its cached count is stale (new replicas, or 10 s without a call), and logs a WARNING for
    each replica that did not answer within `RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S` (0.1 s): under load, a
    replica whose cores are busy answers late, and the log took hundreds of these a minute, which read as a fault.
    What a late answer means is Serve's, and kept on purpose: that replica is left out of this one choice (the call
    goes to a candidate that answered; when none did, the router backs off and asks again with twice the deadline, up
    to 1 s), and a replica that died is found by the error of its probe, not by the deadline. So the first such line
    is logged, then one per `every_s` at most, saying how many it stands for."""

    def __init__(self, every_s: float = PROBE_LOG_EVERY_S, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.every_s, self.clock = every_s, clock
        self.held, self.last = 0, None
        self._lock = threading.Lock()  # NOTE: the routers log from their own event loop's thread

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(PROBE_TIMEOUT)):
            return True
        with self._lock:
            now = self.clock()
            if self.last is not None and now - self.last < self.every_s:
                self.held += 1
                return False
            if self.held:
                record.msg = (
                    f"{record.msg} (and {self.held} more replicas' probes timed out in the last {now - self.last:.0f} "
                    "s: replicas busy, the calls went to others that answered)"
                )
            self.held, self.last = 0, now
            return True


def quiet_probe_timeouts(logger_name: str = "ray.serve") -> None:
    """`_ProbeTimeouts` on Serve's logger, in a process whose handles route calls."""
    _install(_ProbeTimeouts, logger_name)


__all__ = ["LLM_GONE", "PROBE_TIMEOUT", "REPLICA_GONE", "quiet_client_errors", "quiet_probe_timeouts", "root_cause"]
