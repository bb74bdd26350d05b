"""A client's error raised in a replica is one WARNING line; our own errors keep their ERROR and traceback; the routers'
probes of busy replicas are one line a minute."""

from __future__ import annotations

import logging
import pickle

import pytest
from ray.exceptions import TaskCancelledError

from deployments.errors import PROBE_TIMEOUT, _ProbeTimeouts, quiet_client_errors
from schemas import ChannelLost, EncoderUnavailable, InvalidRequest, Overloaded


def _log_failure(logger: logging.Logger, error: Exception) -> None:
    try:
        raise error
    except Exception:
        logger.exception("Request failed.")  # what Serve's replica does with any exception a method raises


def test_a_client_error_is_one_warning_line_and_ours_keep_the_traceback(caplog):
    logger = logging.getLogger("tests.quiet_client_errors")
    quiet_client_errors(logger.name)
    quiet_client_errors(logger.name)  # twice is once
    assert len(logger.filters) == 1
    with caplog.at_level(logging.INFO, logger=logger.name):
        _log_failure(logger, InvalidRequest("image 0: image file is truncated", param="messages"))
        _log_failure(logger, RuntimeError("the engine stopped"))
        _log_failure(logger, TaskCancelledError())  # Serve's HTTP task when the client closed its connection
    client, ours, left = caplog.records
    assert (client.levelno, client.exc_info) == (logging.WARNING, None)
    assert "client's error (400): image 0: image file is truncated" in client.getMessage()
    assert "Traceback" not in caplog.handler.format(client)
    assert ours.levelno == logging.ERROR and ours.exc_info is not None and ours.getMessage() == "Request failed."
    assert (left.levelno, left.exc_info) == (logging.INFO, None) and "closed its connection" in left.getMessage()


def test_a_task_left_failed_by_a_client_that_left_is_one_info_line(caplog):
    """What asyncio logs for Serve's HTTP task when a client closes its connection mid-response."""
    quiet_client_errors()
    asyncio_logger = logging.getLogger("asyncio")
    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        for error in (TaskCancelledError(), RuntimeError("a real bug")):
            asyncio_logger.error("Task exception was never retrieved", exc_info=(type(error), error, None))
    left, bug = caplog.records
    assert (left.levelno, left.exc_info) == (logging.INFO, None) and "closed its connection" in left.getMessage()
    assert bug.levelno == logging.ERROR and bug.exc_info is not None


@pytest.mark.parametrize(
    "error",
    [
        InvalidRequest("bad image", param="messages[0]", code="invalid_image", status=413),
        Overloaded("queue full", retry_after_s=5),
        EncoderUnavailable("encoder gone", [0, 2]),
        ChannelLost("r1"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_cross_processes_whole(error):
    """Ray pickles an error raised in a replica to its caller: one that cannot be rebuilt reaches the ingress as
    Ray's own error (a ChannelLost once did, and its requests failed without the retry they were owed)."""
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and again.args == error.args
    assert vars(again) == vars(error)


def test_probe_timeouts_are_one_line_a_minute_counting_the_others(caplog):
    """Serve's router words each late queue-length answer as one WARNING: the first is logged, then one a minute at
    most, saying how many it stands for; other lines pass untouched."""
    now = [0.0]
    logger = logging.getLogger("test.probes")
    logger.addFilter(_ProbeTimeouts(every_s=60.0, clock=lambda: now[0]))

    def probe(replica: str) -> None:  # as ray/serve/_private/request_router/request_router.py logs it
        logger.warning(f"{PROBE_TIMEOUT}Replica(id='{replica}') within 0.1s. If this happens repeatedly ...")

    with caplog.at_level(logging.INFO, logger="test.probes"):
        probe("a")
        for t in range(1, 300):  # five a second for a minute, on two replicas
            now[0] = t / 5
            probe("ab"[t % 2])
            logger.info("an unrelated line %d", t)
        now[0] = 61.0
        probe("b")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(PROBE_TIMEOUT)]
    assert len(lines) == 2 and "more replicas' probes" not in lines[0]
    assert "Replica(id='b')" in lines[1] and "(and 299 more replicas' probes timed out in the last 61 s" in lines[1]
    assert sum(r.getMessage().startswith("an unrelated line") for r in caplog.records) == 299
