"""Generator.start_all, without Ray: a text completion's prompts start at once, their choices numbered prompt by
prompt, and when one prompt fails the generations the others started are closed (cancelled), not leaked."""

from __future__ import annotations

import asyncio

import pytest

from deployments.ingress.generate import Generator
from deployments.ingress.prepare import Prepared
from schemas import InvalidRequest


class FakeStream:
    def __init__(self):
        self.closed = False

    async def aclose(self):
        self.closed = True


def _generator(fail_prompt: int | None = None, delay_s: dict[int, float] | None = None):
    """A Generator whose `start` opens fake streams (first delta: the choice's number), failing for `fail_prompt`."""
    gen = Generator.__new__(Generator)
    opened: list[FakeStream] = []

    async def start(p, params, stops, request_id, first=0):
        await asyncio.sleep((delay_s or {}).get(p.prompt[0], 0))
        if p.prompt[0] == fail_prompt:
            raise InvalidRequest(f"prompt {fail_prompt} is bad")
        streams = [FakeStream() for _ in params]
        opened.extend(streams)
        return streams, [first + i for i in range(len(params))]

    gen.start = start
    return gen, opened


def _start_all(gen: Generator, n: int = 2, prompts: int = 3):
    return asyncio.run(gen.start_all([Prepared(prompt=[k]) for k in range(prompts)], [[None] * n] * prompts, [], "r"))


def test_choices_are_numbered_prompt_by_prompt():
    gen, opened = _generator(delay_s={0: 0.02})  # the first prompt starts last: the order is still the prompts'
    streams, firsts = _start_all(gen)
    assert firsts == [0, 1, 2, 3, 4, 5] and len(streams) == 6 and not any(s.closed for s in opened)


@pytest.mark.parametrize("delay_s", [{}, {1: 0.05}, {0: 0.05, 2: 0.05}])
def test_one_failing_prompt_closes_what_the_others_started(delay_s):
    """Whether the others started before the failure or were still starting (then cancelled), nothing stays open."""
    gen, opened = _generator(fail_prompt=1, delay_s=delay_s)
    with pytest.raises(InvalidRequest, match="prompt 1 is bad"):
        _start_all(gen)
    assert all(s.closed for s in opened)
    if not delay_s:
        assert len(opened) == 4  # prompts 0 and 2 had started: their streams were closed
