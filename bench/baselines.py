"""transformers baselines on the same checkpoint and requests: one request at a time, and static padded batches."""

from __future__ import annotations

import io
import time
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration
from transformers.generation.streamers import BaseStreamer

from bench.metrics import RequestResult
from bench.simulate import Timing, simulate
from bench.workload import BenchRequest, hf_messages


class _StepClock(BaseStreamer):
    """generate() hands the streamer the prompt once, then each step's new tokens: timestamp those steps."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


class HFRunner:
    """Qwen2VLForConditionalGeneration.generate, prompts built as tests/deployments/test_stack_parity.py does."""

    def __init__(self, checkpoint: Path, threads: int, dtype: str = "float32"):
        torch.set_num_threads(threads)
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.processor = AutoImageProcessor.from_pretrained(checkpoint)
        self.model = Qwen2VLForConditionalGeneration.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
        self.image_token_id = self.model.config.image_token_id
        self.pad_id = self.model.generation_config.pad_token_id
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        merge = self.model.config.vision_config.spatial_merge_size
        self.merge_area = merge * merge

    def _inputs(self, requests: list[BenchRequest]) -> dict[str, torch.Tensor]:
        """Chat template, image grids, placeholder expansion; rows left-padded to the longest prompt."""
        rows, images = [], []
        for req in requests:
            text = self.tokenizer.apply_chat_template(hf_messages(req), tokenize=False, add_generation_prompt=True)
            rows.append(self.tokenizer.encode(text, add_special_tokens=False))
            images += [Image.open(io.BytesIO(png)).convert("RGB") for png in req.images]
        kwargs: dict[str, torch.Tensor] = {}
        if images:
            processed = self.processor(images=images, return_tensors="pt")
            counts = iter((processed["image_grid_thw"].prod(-1) // self.merge_area).tolist())
            pad = self.image_token_id
            rows = [[t for tok in row for t in ([pad] * next(counts) if tok == pad else [tok])] for row in rows]
            kwargs = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
        width = max(map(len, rows))
        input_ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows])
        attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "mm_token_type_ids": (input_ids == self.image_token_id).int(),
            **kwargs,
        }

    def generate(
        self, requests: list[BenchRequest], steps: int | None = None, scores: bool = False
    ) -> tuple[torch.Tensor, list[float], float, list[int], tuple]:
        """One batch, timed from before image decoding (a server does that work too) to generate's return.

        Returns (new tokens (B, steps), step times, end time, prompt lengths, per-step logits), times from start.
        The batch runs to its longest output; min_new_tokens forces every length, as ignore_eos does on the server.
        """
        steps = steps or max(r.output_len for r in requests)
        clock = _StepClock()
        start = time.perf_counter()
        inputs = self._inputs(requests)
        with torch.inference_mode():
            out = self.model.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=steps,
                min_new_tokens=steps,
                pad_token_id=self.pad_id,
                streamer=clock,
                return_dict_in_generate=True,
                output_logits=scores,
            )  # raw: min_new_tokens puts -inf in the scores
        end = time.perf_counter() - start
        prompt_lens = inputs["attention_mask"].sum(-1).tolist()
        new = out.sequences[:, inputs["input_ids"].shape[1] :]
        return new, [t - start for t in clock.times], end, prompt_lens, out.logits or ()

    def time_batch(self, requests: list[BenchRequest], own_end: bool) -> tuple[list[Timing], float]:
        """Timings per request: its own tokens' times; it ends at its own last token or (static) the batch's end."""
        _, times, end, prompt_lens, _ = self.generate(requests)
        if len(times) != max(r.output_len for r in requests):
            raise RuntimeError(f"generate made {len(times)} steps, expected {max(r.output_len for r in requests)}")
        timings = [
            Timing(times[: r.output_len], times[r.output_len - 1] if own_end else end, p)
            for r, p in zip(requests, prompt_lens, strict=True)
        ]
        return timings, end

    def self_check(self, requests: list[BenchRequest], steps: int = 8) -> str | None:
        """Padded-batch greedy tokens must equal each request's unbatched ones; None if so, else what differs.

        With random weights the top-2 logits can be nearly tied, and padding changes float rounding; a divergence
        at such a near-tie is reported as harmless, any other one as a warning.
        """
        batch, _, _, _, batch_scores = self.generate(requests, steps, scores=True)
        problems = []
        for row, req in enumerate(requests):
            alone, _, _, _, alone_scores = self.generate([req], steps, scores=True)
            a, b = alone[0].tolist(), batch[row].tolist()
            if a == b:
                continue
            k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            logits = alone_scores[k][0].clone()
            logits[self.eos_ids] = float("-inf")  # greedy chose among the others (min_new_tokens)
            top2 = logits.topk(2).values
            gap = float(top2[0] - top2[1])
            diff = max(float((alone_scores[i][0] - batch_scores[i][row]).abs().max()) for i in range(k + 1))
            kind = "near-tie, harmless" if gap <= 10 * max(diff, 1e-6) else "NOT a near-tie"
            problems.append(
                f"request {req.index}: step {k} differs ({kind}: top-2 gap {gap:.2e}, "
                f"max |logit diff| up to there {diff:.2e})"
            )
        return "; ".join(problems) or None


def run_one_at_a_time(
    runner: HFRunner,
    requests: list[BenchRequest],
    concurrency: int,
    max_measured: int,
    cache: dict[int, Timing],
    arrivals: list[float] | None,
) -> tuple[list[RequestResult], float]:
    """A server that serves one request at a time, FIFO. A request's service does not depend on the load, so each
    is timed once (into `cache`); past `max_measured`, request i reuses request i % max_measured's service (a
    bootstrap of the measured distribution), so the queueing still sees the full load."""

    def serve_one(batch: list[int]) -> tuple[list[Timing], float]:
        j = batch[0] % max_measured
        if j not in cache:
            cache[j] = runner.time_batch([requests[j]], own_end=True)[0][0]
        return [cache[j]], cache[j].end

    expected = [requests[i % max_measured].output_len for i in range(len(requests))]
    return simulate(len(requests), concurrency, 1, serve_one, expected, arrivals)


def run_static_batches(
    runner: HFRunner, requests: list[BenchRequest], concurrency: int, arrivals: list[float] | None
) -> tuple[list[RequestResult], float]:
    """A server that takes up to `concurrency` waiting requests, runs them as one padded batch to the longest
    output, and answers all of them when the batch ends. Only each request's own tokens count as output."""

    def serve_batch(batch: list[int]) -> tuple[list[Timing], float]:
        return runner.time_batch([requests[i] for i in batch], own_end=False)

    return simulate(len(requests), concurrency, concurrency, serve_batch, [r.output_len for r in requests], arrivals)
