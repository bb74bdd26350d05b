"""The soak's log check (bench/soak_probe.py): which logged errors fail a soak, and which are Ray Serve's own."""

from __future__ import annotations

from bench.soak_probe import problems, upstream

ROUTER_ERROR = """INFO 2026-11-27 01:47:04,100 bench_Ingress x r -- POST / 200 3.0ms
ERROR 2026-11-27 01:47:04,156 bench_Ingress x r -- Unexpected error in _fulfill_pending_requests.
Traceback (most recent call last):
  File "/v/site-packages/ray/serve/_private/request_router/request_router.py", line 1307, in _fulfill_pending_requests
    self._fulfill_next_pending_request(
{frame}    pending.future.set_result(replica)
asyncio.exceptions.InvalidStateError: invalid state
WARNING 2026-11-27 01:47:05,000 bench_Ingress x r -- a client's error (400)
"""
OUR_FRAME = '  File "/work/main/deployments/llm/router.py", line 76, in _fulfill_next_pending_request\n'
SERVES_FRAME = '  File "/v/site-packages/ray/serve/_private/request_router/request_router.py", line 446, in _fulfill\n'


def test_serves_own_router_error_is_counted_apart_but_not_one_raised_through_our_code():
    """The router error of Ray 2.60 is Serve's when its frames are all Serve's; raised through our router's override
    it was ours (a soak once counted it as Serve's), and fails the soak."""
    [theirs] = problems("replica.log", ROUTER_ERROR.format(frame=SERVES_FRAME))
    [ours] = problems("replica.log", ROUTER_ERROR.format(frame=OUR_FRAME))
    assert "InvalidStateError" in theirs and upstream(theirs)
    assert "InvalidStateError" in ours and not upstream(ours)


def test_only_errors_and_tracebacks_are_problems():
    text = "INFO 2026-11-27 01:00:00,000 a -- fine\nWARNING 2026-11-27 01:00:01,000 a -- a 400\n"
    assert problems("a.log", text) == []
    text += "ERROR 2026-11-27 01:00:02,000 a -- request r failed\nTraceback (most recent call last):\nValueError: x\n"
    assert problems("a.log", text) == ["a.log: ERROR 2026-11-27 01:00:02,000 a -- request r failed ... ValueError: x"]
