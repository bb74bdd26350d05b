"""The soak's load (bench/soak.py): the seeded mix of good, streaming, cancelled and bad requests, and the client
that sends them and records each one's outcome."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx
from PIL import Image

from demo.inputs import data_url, image_bytes, make_image

MIX = {"good": 0.35, "stream": 0.25, "cancel": 0.15, "bad": 0.25}
PROMPTS = [
    "Describe the picture.",
    "What colours do you see?",
    "hi",
    "Count the objects, then name them.",
    "Write one sentence about the sea.",
    "Is this image dark or light? Answer briefly.",
]


@dataclass(slots=True)
class Case:
    category: str  # good | stream | cancel | bad
    kind: str
    method: str = "POST"
    path: str = "/v1/chat/completions"
    body: Any = None  # a dict is sent as JSON, bytes as they are
    expect: int = 200
    close: str = ""  # cancel: "first" (after the first content chunk), "delay", "timeout"
    delay_s: float = 0.0


@dataclass(slots=True)
class Outcome:
    category: str
    kind: str
    status: str  # the HTTP status, or "timeout" / "closed" (the client left first), or "error:<exception>"
    latency_s: float
    ok: bool
    detail: str = ""


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _b64(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class Mix:
    """The seeded request mix. Images are encoded once: bodies share the pool's data URLs."""

    SIZES = [(32, 32), (64, 48), (100, 80), (150, 120), (17, 90), (224, 224), (300, 260), (90, 300)]

    def __init__(self, seed: int, model: str | None = None):
        self.seed, self.model = seed, model
        self.pool = [data_url(make_image(w, h, seed=1000 + i)) for i, (w, h) in enumerate(self.SIZES)]
        png = image_bytes(make_image(64, 64))
        user = lambda *parts: {"messages": [{"role": "user", "content": list(parts)}], "max_tokens": 4}  # noqa: E731
        hi = [{"role": "user", "content": "hi"}]
        self.bad: list[tuple[str, Any, int]] = [  # (kind, body, status)
            ("not_json", b"{not json", 400),
            ("wrong_type", {"messages": hi, "temperature": "hot"}, 400),
            ("content_wrong_type", {"messages": [{"role": "user", "content": 5}]}, 400),
            ("invalid_base64", user(_image("data:image/png;base64,%%%%")), 400),
            ("not_an_image", user(_image(_b64(b"plain text, not pixels"))), 400),
            ("truncated_png", user(_image(_b64(png[: len(png) // 2]))), 400),  # fails in the encoder replica
            ("over_pixel_cap", user(_image(data_url(Image.new("RGB", (641, 640), "red")))), 400),
            ("too_many_images", user(*[_image(_b64(png))] * 5), 400),
            ("n_over_limit", {"messages": hi, "n": 9}, 400),
            ("max_tokens_over_context", {"messages": hi, "max_tokens": 5000}, 400),
            ("prompt_over_context", {"messages": [{"role": "user", "content": "word " * 1100}]}, 400),
            ("empty_messages", {"messages": []}, 400),
            ("typed_placeholder", user({"type": "text", "text": "<|image_pad|>"}), 400),
            ("image_from_assistant", {"messages": [{"role": "assistant", "content": [_image(_b64(png))]}]}, 400),
            ("too_many_stops", {"messages": hi, "stop": list("abcde")}, 400),
            ("unknown_model", {"model": "gpt-4o", "messages": hi}, 404),
            ("unknown_route", None, 404),
            ("wrong_method", None, 405),
            ("body_over_limit", b"x" * (3 << 20), 413),
        ]  # fmt: skip

    def cases(self, n: int, offset: int = 0) -> list[Case]:
        """Request i's category and good body depend only on the seed and i; bad ones take the bad kinds in turn."""
        out, num_bad = [], 0
        for i in range(offset, offset + n):
            out.append(self.case(i, num_bad))
            num_bad += out[-1].category == "bad"
        return out

    def case(self, i: int, num_bad: int = 0) -> Case:
        rng = random.Random(self.seed * 1_000_003 + i)
        category = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        if category == "bad":
            kind, body, status = self.bad[num_bad % len(self.bad)]
            if kind == "unknown_route":
                return Case("bad", kind, path="/v1/nope", body={"messages": []}, expect=status)
            if kind == "wrong_method":
                return Case("bad", kind, method="GET", expect=status)
            if isinstance(body, dict):  # a bad streaming request gets its status too, not a 200 and an event
                body = {**body, "stream": rng.random() < 0.5}
            return Case("bad", kind, body=body, expect=status)
        body, kind = self._good(rng, i)
        if category == "good":
            return Case("good", kind, body=body)
        body["stream"] = True
        if category == "stream":
            return Case("stream", kind, body={**body, "stream_options": {"include_usage": rng.random() < 0.5}})
        close = rng.choice(["first", "delay", "timeout"])
        body.update(max_tokens=rng.randint(64, 256), ignore_eos=True, stream=close != "timeout", n=1)
        return Case("cancel", close, body=body, close=close, delay_s=rng.uniform(0.02, 0.4))

    def _good(self, rng: random.Random, i: int) -> tuple[dict, str]:
        num_images = rng.choices([0, 1, 2], weights=[0.4, 0.4, 0.2])[0]
        urls = []
        for k in range(num_images):
            if rng.random() < 0.85:
                urls.append(self.pool[rng.randrange(len(self.pool))])
            else:  # a new image: an embedding-cache miss and a new LRU entry
                urls.append(data_url(make_image(rng.randint(20, 96), rng.randint(20, 96), seed=i * 7 + k)))
        content = [*map(_image, urls), {"type": "text", "text": rng.choice(PROMPTS)}]
        messages = [{"role": "user", "content": content}]
        if rng.random() < 0.1:  # a second turn re-sends the first: prefix reuse
            messages += [{"role": "assistant", "content": "Some answer."}, {"role": "user", "content": "More?"}]
        body: dict[str, Any] = {"messages": messages, "max_tokens": rng.randint(4, 16)}
        if self.model and rng.random() < 0.3:
            body["model"] = self.model
        if rng.random() < 0.5:
            body.update(temperature=0.8, seed=rng.randrange(1 << 30))
        else:
            body["temperature"] = 0
        extras = {
            "n": 2,
            "stop": ["e", "."],
            "logprobs": True,
            "return_token_ids": True,
            "user": "soak",
            "metadata": {"unknown": [1, {"x": None}]},
        }  # the last two: fields our server ignores
        for key in rng.sample(list(extras), k=rng.choice([0, 0, 1, 2])):
            body[key] = extras[key]
            if key == "logprobs":
                body["top_logprobs"] = 2
        return body, f"{num_images}img" + (f"+{len(messages) // 2 + 1}turns" if len(messages) > 1 else "")


async def _read_stream(response: httpx.Response, close_first: bool) -> tuple[bool, str]:
    """(ok, detail) of a 200 stream; stops at the first content chunk when close_first."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return True, "done"
        event = json.loads(line[6:])
        if "error" in event:
            return False, f"error event: {event['error'].get('message')}"
        if close_first and any(c.get("delta", {}).get("content") for c in event.get("choices") or []):
            return True, "closed after the first content chunk"
    return False, "stream ended without [DONE]"


async def run_case(client: httpx.AsyncClient, case: Case, timeout_s: float) -> Outcome:
    start, head = time.monotonic(), {}
    kwargs: dict[str, Any] = {"json": case.body} if isinstance(case.body, dict) else {"content": case.body}
    if isinstance(case.body, bytes):
        kwargs["headers"] = {"content-type": "application/json"}

    async def exchange() -> tuple[bool, str]:
        if case.close == "timeout":
            kwargs["timeout"] = case.delay_s
        async with client.stream(case.method, case.path, **kwargs) as r:
            head["status"] = r.status_code
            if r.status_code != 200 or not (isinstance(case.body, dict) and case.body.get("stream")):
                body = await r.aread()
                if r.status_code >= 400:  # every error has OpenAI's body
                    error = json.loads(body).get("error") if body.startswith(b"{") else None
                    return r.status_code == case.expect and bool(error), str((error or {}).get("message"))[:200]
                choices = json.loads(body).get("choices")
                return case.expect == 200 and bool(choices), f"{len(choices or [])} choices"
            ok, detail = await _read_stream(r, close_first=case.close == "first")
            return ok and case.expect == 200, detail

    limit = case.delay_s if case.close == "delay" else timeout_s
    try:
        async with asyncio.timeout(limit):
            ok, detail = await exchange()
        status = str(head["status"])
    except (TimeoutError, httpx.TimeoutException):
        left = case.delay_s if case.close else limit
        status, detail = ("closed" if "status" in head else "timeout"), f"client left after {left:.2f}s"
        ok = case.category == "cancel"  # for anyone else, no answer in time is a failure
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        status, ok, detail = f"error:{type(e).__name__}", False, str(e)[:200]
    if status.startswith("5"):
        ok = False
    return Outcome(case.category, case.kind, status, time.monotonic() - start, ok, detail)


async def drive(base_url: str, cases: list[Case], concurrency: int, timeout_s: float = 120) -> list[Outcome]:
    """Closed loop: `concurrency` workers, each sending its next case when the last one is answered."""
    out: list[Outcome] = [None] * len(cases)  # type: ignore[list-item]
    todo = iter(enumerate(cases))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:

        async def worker() -> None:
            for i, case in todo:
                out[i] = await run_case(client, case, timeout_s)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


# ---- Measurements: from this process, which must be a driver of the app's Ray cluster --------------------------
