"""Load generator: streaming OpenAI chat requests over HTTP, closed loop or Poisson, per-token timestamps."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from bench.metrics import RequestResult


async def _one(client: httpx.AsyncClient, index: int, body: dict, t0: float, timeout: float) -> RequestResult:
    """One streamed request. Every failure (status, error event, timeout, broken stream) becomes a failed result."""
    sent = time.perf_counter()
    result = RequestResult(index, ok=False, sent=sent - t0, expected_tokens=body["max_tokens"])
    last: float | None = None
    usage, done, seen = None, False, 0
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    result.error = f"HTTP {response.status_code}: {text[:160]}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = f"error event: {str(chunk['error'].get('message'))[:160]}"
                        return result
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        ids = choice.get("token_ids") or []
                        if not ((choice.get("delta") or {}).get("content") or ids):
                            continue  # the role-only first chunk and the finish chunk carry no tokens
                        now = time.perf_counter()
                        if last is None:
                            result.ttft = now - sent
                        else:
                            result.itls.append(now - last)
                        last, seen = now, seen + len(ids)
                        result.chunks += 1
    except TimeoutError:
        result.error = f"timeout after {timeout:g}s"
        return result
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, AttributeError) as e:
        result.error = f"{type(e).__name__}: {str(e)[:160]}"
        return result
    result.e2e = time.perf_counter() - sent
    if not done:
        result.error = "stream ended without [DONE]"
    elif usage is None:
        result.error = "no usage chunk (stream_options.include_usage was set)"
    elif last is None:
        result.error = "no token chunk"
    else:
        result.ok = True
        result.output_tokens = int(usage["completion_tokens"])
        result.prompt_tokens = int(usage["prompt_tokens"])
        if seen and seen != result.output_tokens:  # the stream and the usage disagree: worth knowing
            result.error = f"usage says {result.output_tokens} tokens, the stream carried {seen}"
    return result


async def run_load(
    base_url: str, bodies: list[dict], concurrency: int, arrivals: list[float] | None, timeout: float
) -> tuple[list[RequestResult], float]:
    """At most `concurrency` in flight; closed loop (next request as soon as a slot frees) or Poisson arrivals.

    Returns the results in request order and the wall time from the start to the last completion.
    """
    gate = asyncio.Semaphore(concurrency)  # FIFO: waiting requests go out in index order
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    http_timeout = httpx.Timeout(timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=http_timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def task(i: int, body: dict) -> RequestResult:
            if arrivals is not None:
                await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            async with gate:
                return await _one(client, i, body, t0, timeout)

        results = await asyncio.gather(*(task(i, b) for i, b in enumerate(bodies)))
        wall = time.perf_counter() - t0
    return list(results), wall


def load(
    base_url: str, bodies: list[dict], concurrency: int, arrivals: list[float] | None, timeout: float
) -> tuple[list[RequestResult], float]:
    return asyncio.run(run_load(base_url, bodies, concurrency, arrivals, timeout))
