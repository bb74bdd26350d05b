"""Time limits, overload and clients that leave: a request past its deadline is a 408 (or an error event on a
stream), a full engine queue is a 503 with Retry-After that the openai client retries, and the work under a
request that ends stops, in the encoders and in the engine."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time

import httpx
import openai
import pytest
from ray import serve

from demo.inputs import data_url, make_image
from deployments.encoder.server import Encoder
from deployments.ingress import Ingress
from deployments.llm.server import LLM
from tests.api_schema import assert_valid
from tests.deployments.instruments import (
    SlowEncoder,
    SlowLM,
    forwards,
    forwards_finished,
    forwards_started,
    images_preprocessed,
)

pytestmark = pytest.mark.e2e
SMALL = {"num_cpus": 0.1}
# An encoder forward outlasts a request's deadline; the deadline leaves a loaded CI machine seconds to fill the queue.
DEADLINE_S, ENCODE_S = 4.0, 5.0
CAP_S = 60.0  # how long a wait on state may take before the test fails: generous, never the assertion itself


@pytest.fixture(scope="module")
def slow(ray_serve, app_args, tmp_path_factory):
    record_dir = str(tmp_path_factory.mktemp("forwards"))
    args = {
        **app_args,
        "limits": {**app_args["limits"], "request_timeout_s": DEADLINE_S},
        "encoder": {"cache_gib": 0, "max_batch_wait_ms": 0, "startup_check": False},  # as test_encoder_faults
        "llm": {**app_args["llm"], "max_num_seqs": 1, "max_queued_requests": 1},
    }  # one runs, one waits
    encoder = Encoder.options(ray_actor_options=SMALL, autoscaling_config=None, num_replicas=1).bind(
        args, model_factory=functools.partial(SlowEncoder, delay_s=ENCODE_S, record_dir=record_dir)
    )
    llm = LLM.options(ray_actor_options=SMALL).bind(args, model_factory=SlowLM.load)
    serve.run(Ingress.options(ray_actor_options=SMALL).bind(encoder, llm, args), name="slow", route_prefix="/slow")
    yield f"{ray_serve}/slow", record_dir
    serve.delete("slow")


@pytest.fixture(scope="module")
def queue_app(ray_serve, app_args):
    """One sequence runs, one waits, and deadlines far away: the queue stays full until the test empties it."""
    args = {
        **app_args,
        "limits": {**app_args["limits"], "request_timeout_s": 120},
        "encoder": {"cache_gib": 0, "startup_check": False},
        "llm": {**app_args["llm"], "max_num_seqs": 1, "max_queued_requests": 1},
    }
    encoder = Encoder.options(ray_actor_options=SMALL, autoscaling_config=None, num_replicas=1).bind(args)
    llm = LLM.options(ray_actor_options=SMALL).bind(args, model_factory=SlowLM.load)
    serve.run(Ingress.options(ray_actor_options=SMALL).bind(encoder, llm, args), name="queue", route_prefix="/queue")
    yield f"{ray_serve}/queue"
    serve.delete("queue")


def _stats(deployment: str, app: str = "slow") -> dict:
    return serve.get_deployment_handle(deployment, app_name=app).stats.remote().result()


async def _until(condition, timeout_s: float = CAP_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _images(*seeds: int) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": data_url(make_image(56, 56, seed=s))}} for s in seeds]


LONG = {"messages": [{"role": "user", "content": "Talk."}], "max_tokens": 200, "temperature": 0}  # >= 10 s of steps


def test_a_request_past_its_deadline_is_a_408_and_frees_its_sequence(slow):
    url, _ = slow
    before = _stats("LLM")
    started = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", json=LONG, timeout=30)
    assert r.status_code == 408, r.text
    assert DEADLINE_S <= time.monotonic() - started < DEADLINE_S + 20  # a generous cap; LONG takes >= 10 s
    assert_valid("ErrorResponse", r.json())
    error = r.json()["error"]
    assert error["code"] == "request_timeout" and f"deadline of {DEADLINE_S:g} s" in error["message"]
    _wait_for(lambda: _stats("LLM")["cancelled"] == before["cancelled"] + 1, CAP_S)
    assert _stats("LLM")["running"] == 0


def test_a_stream_past_its_deadline_ends_with_an_error_event(slow):
    url, _ = slow
    before = _stats("LLM")
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**LONG, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert any(json.loads(e)["choices"][0]["delta"].get("content") for e in events[1:-2])  # tokens came first
    for e in events[:-2]:
        assert_valid("CreateChatCompletionStreamResponse", json.loads(e))
    assert_valid("ErrorResponse", json.loads(events[-2]))
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    _wait_for(lambda: _stats("LLM")["cancelled"] == before["cancelled"] + 1, CAP_S)
    assert _stats("LLM")["running"] == 0


def test_a_slow_encoder_gives_a_408_and_the_encode_is_cancelled(slow):
    url, record_dir = slow
    before, seen = _stats("Encoder")["cancelled"], len(forwards(record_dir))
    body = {"messages": [{"role": "user", "content": [*_images(1), {"type": "text", "text": "hi"}]}], "max_tokens": 2}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 408, r.text
    assert_valid("ErrorResponse", r.json())
    _wait_for(lambda: _stats("Encoder")["cancelled"] == before + 1, CAP_S)
    _wait_for(lambda: len(forwards(record_dir)) == seen + 1, CAP_S)  # the forward it was in runs out


def test_a_client_that_leaves_cancels_its_queued_images(slow):
    """A holds the encoder for ENCODE_S; B's two images wait behind it. B's client leaves: they are never encoded."""
    url, record_dir = slow
    seen, before = len(forwards(record_dir)), _stats("Encoder")["cancelled"]
    started, queued = sum(forwards_started(record_dir).values()), images_preprocessed(record_dir)

    def ask(seed: int, *more: int) -> dict:
        return {
            "messages": [{"role": "user", "content": [*_images(seed, *more), {"type": "text", "text": "q"}]}],
            "max_tokens": 1,
            "temperature": 0,
        }

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            # A's answer is a 408 (ENCODE_S of encoding > DEADLINE_S); what matters is that it holds the encoder.
            a = asyncio.create_task(client.post("/v1/chat/completions", json=ask(10)))
            await _until(lambda: sum(forwards_started(record_dir).values()) == started + 1)  # A's forward runs
            b = asyncio.create_task(client.post("/v1/chat/completions", json=ask(11, 12)))
            await _until(lambda: images_preprocessed(record_dir) == queued + 3)  # B's two wait behind it
            assert not forwards_finished(record_dir).total() > seen, "A's forward ended before B left"
            b.cancel()  # B's client leaves
            await asyncio.gather(b, return_exceptions=True)
            await a

    asyncio.run(scenario())
    _wait_for(lambda: _stats("Encoder")["cancelled"] >= before + 3, CAP_S)  # A's one (deadline) and B's two
    # Another image, C, after B left: the encoder takes it once it is free. B's, had they stayed queued, would
    # have gone before it.
    httpx.post(f"{url}/v1/chat/completions", json=ask(13), timeout=30)
    _wait_for(lambda: len(forwards(record_dir)) >= seen + 2, CAP_S)
    assert [n for _, _, n in forwards(record_dir)[seen:]] == [1, 1]  # A's image and C's: none of B's


def test_a_full_engine_queue_is_a_503_that_the_openai_client_retries(queue_app):
    url, release, refused = queue_app, threading.Event(), threading.Event()

    def hog():  # a stream that holds its sequence (running or queued) until released, then leaves
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json={**LONG, "max_tokens": 900, "stream": True}, timeout=120
        ) as r:
            for _ in r.iter_lines():
                if release.is_set():
                    return

    hogs = [threading.Thread(target=hog) for _ in range(2)]
    hogs[0].start()  # one running...
    _wait_for(lambda: _stats("LLM", "queue")["running"] == 1, 60.0)
    hogs[1].start()  # ...and one waiting: the queue is full until the hogs leave
    _wait_for(lambda: _stats("LLM", "queue")["waiting"] == 1, 60.0)
    r = httpx.post(f"{url}/v1/chat/completions", json={**LONG, "max_tokens": 2}, timeout=60)
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
    assert_valid("ErrorResponse", r.json())
    assert r.json()["error"]["code"] == "overloaded"
    # The openai client waits Retry-After and tries again; the hogs leave once its first try was refused.
    hooks = {"response": [lambda resp: refused.set() if resp.status_code == 503 else None]}
    client = openai.OpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=10, http_client=httpx.Client(event_hooks=hooks, timeout=60)
    )
    answer = []
    asker = threading.Thread(
        target=lambda: answer.append(
            client.chat.completions.with_raw_response.create(
                model="qwen2-vl-tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
        )
    )
    asker.start()
    assert refused.wait(60), "the client's first try was not refused"
    release.set()
    asker.join(120)
    assert answer and answer[0].retries_taken >= 1 and answer[0].parse().usage.completion_tokens == 2
    for h in hogs:
        h.join(60)
    _wait_for(lambda: _stats("LLM", "queue")["running"] == 0 and _stats("LLM", "queue")["waiting"] == 0, 60.0)
