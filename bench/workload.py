"""Deterministic multimodal workload: random-word prompts, noise PNGs, output lengths, Poisson arrivals."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field

import numpy as np
from PIL import Image
from transformers import PreTrainedTokenizerBase

ARRIVALS_STREAM = 1_000_003  # a seed-sequence key no request index uses, so arrivals never alias a request's draws


@dataclass(slots=True)
class BenchRequest:
    index: int
    text: str
    text_tokens: int  # the text's own token count (the chat template and image placeholders come on top)
    images: list[bytes] = field(repr=False)  # PNG bytes, placed before the text in the user message
    image_sizes: list[tuple[int, int]]  # (width, height)
    output_len: int  # forced with ignore_eos (server) / min_new_tokens (transformers)


def parse_sizes(spec: str) -> list[tuple[int, int]]:
    """'64x64,224x160' -> [(64, 64), (224, 160)] as (width, height)."""
    sizes = []
    for item in spec.split(","):
        w, _, h = item.strip().lower().partition("x")
        if not (w.isdigit() and h.isdigit()) or int(w) < 1 or int(h) < 1:
            raise ValueError(f"bad image size {item!r}: expected WIDTHxHEIGHT")
        sizes.append((int(w), int(h)))
    return sizes


def output_range(output_len: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [lo, hi] around output_len, as vllm bench serve's random dataset draws it."""
    lo = max(1, int(output_len * (1 - range_ratio)))
    return lo, max(lo, int(output_len * (1 + range_ratio)))


def _word_pool(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Vocabulary entries that are one space-led alphabetic word: each re-encodes to exactly one token."""
    pool = []
    for piece, token_id in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        if piece.startswith("Ġ") and piece[1:].isalpha():  # byte-level BPE spells a leading space 'Ġ'
            word = tokenizer.decode([token_id])
            if len(tokenizer.encode(word, add_special_tokens=False)) == 1:
                pool.append(word)
    if len(pool) < 16:
        raise RuntimeError(f"the tokenizer has only {len(pool)} single-token words; cannot build prompts")
    return pool


def _prompt(tokenizer: PreTrainedTokenizerBase, pool: list[str], rng: np.random.Generator, n: int) -> tuple[str, int]:
    """About n tokens of random words; re-tokenized and trimmed, since merges across words can change the count."""
    words = [pool[i] for i in rng.integers(0, len(pool), size=n)]
    for _ in range(8):
        text = "".join(words).strip()
        count = len(tokenizer.encode(text, add_special_tokens=False))
        if count == n:
            break
        if count > n:
            words = words[: len(words) - (count - n)]
        else:
            words += [pool[i] for i in rng.integers(0, len(pool), size=n - count)]
    return text, count


def noise_png(width: int, height: int, rng: np.random.Generator) -> bytes:
    """Uniform noise: incompressible, so the request bytes are a realistic upper bound for that size."""
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def make_workload(
    tokenizer: PreTrainedTokenizerBase,
    n: int,
    *,
    seed: int,
    input_len: int,
    images_min: int,
    images_max: int,
    image_sizes: list[tuple[int, int]],
    output_len: int,
    range_ratio: float,
    fixed_sizes: bool = False,
) -> list[BenchRequest]:
    """n requests; request i depends only on (seed, i), so a shorter run is a prefix of a longer one.

    fixed_sizes: every request carries exactly image_sizes, in that order (images_min/max are then ignored), for
    workloads that name their images rather than draw them (bench/peer.py).
    """
    if not 0 <= images_min <= images_max:
        raise ValueError(f"need 0 <= images-min <= images-max, got {images_min}..{images_max}")
    pool, (lo, hi) = _word_pool(tokenizer), output_range(output_len, range_ratio)
    requests = []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        text, count = _prompt(tokenizer, pool, rng, input_len)
        n_images = rng.integers(images_min, images_max + 1)
        sizes = [image_sizes[j] for j in rng.integers(0, len(image_sizes), size=n_images)]
        if fixed_sizes:  # drawn above all the same, so the rest of request i's draws do not depend on the flag
            sizes = list(image_sizes)
        images = [noise_png(w, h, rng) for w, h in sizes]
        requests.append(BenchRequest(i, text, count, images, sizes, int(rng.integers(lo, hi + 1))))
    return requests


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the run's start) with exponential gaps of mean 1/rate; the first request waits one gap too."""
    gaps = np.random.default_rng([seed, ARRIVALS_STREAM]).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps).tolist()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def stream_body(content: str | list[dict], max_tokens: int) -> dict:
    """A streamed, greedy, one-message chat request of exactly `max_tokens`; ignore_eos and return_token_ids are our
    (vLLM-style) extensions."""
    return {
        "messages": [{"role": "user", "content": content}],
        "stream": True, "stream_options": {"include_usage": True},
        "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
        # token ids make every token visible even when its text is held back (partial UTF-8, special tokens),
        # so TTFT/ITL are measured per token chunk, not per printable chunk
        "return_token_ids": True,
    }  # fmt: skip


def chat_body(req: BenchRequest, model: str) -> dict:
    """The OpenAI chat request of a BenchRequest: its images, then its text."""
    content = [{"type": "image_url", "image_url": {"url": data_url(png)}} for png in req.images]
    content.append({"type": "text", "text": req.text})
    return {"model": model, **stream_body(content, req.output_len)}


def hf_messages(req: BenchRequest) -> list[dict]:
    """The same conversation in transformers' chat-template form (one {'type': 'image'} per image)."""
    return [{"role": "user", "content": [{"type": "image"}] * len(req.images) + [{"type": "text", "text": req.text}]}]
