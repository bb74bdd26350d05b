"""Our encoder and engine in this process, no HTTP and no Ray: the engine's own speed, on the baselines' terms.

The server's figures include the proxy, the ingress, Ray messages and the load generator, all on the same cores;
the transformers baselines pay for none of that. This runs the same requests through the same code the replicas
run (prompt building, `Qwen2VLVisionEncoder`, `Engine` with the app's default settings) in-process, so the engine
can be compared with transformers like for like.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from bench.metrics import RequestResult
from bench.workload import BenchRequest, chat_body
from deployments.ingress.prompt import build_prompt, load_tokenizer
from encoders import Qwen2VLImageProcessing, Qwen2VLVisionEncoder, load_rgb
from llm import Engine, EngineConfig, Qwen2LM, num_kv_blocks
from schemas import GenerateRequest, LLMArgs, MediaItem, SamplingParams
from schemas.openai import ChatCompletionRequest


class InProcess:
    def __init__(self, checkpoint: Path, threads: int, max_model_len: int = 4096, dtype: str = "float32"):
        torch.set_num_threads(1)  # as the LLM replica: one thread process-wide, `threads` for the engine's worker
        config, llm_args = AutoConfig.from_pretrained(checkpoint), LLMArgs()
        self.tokenizer = load_tokenizer(checkpoint)
        self.processing = Qwen2VLImageProcessing.from_pretrained(checkpoint)
        self.vision = Qwen2VLVisionEncoder(checkpoint, dtype=getattr(torch, dtype))
        model = Qwen2LM.from_pretrained(checkpoint, dtype=getattr(torch, dtype))
        blocks = num_kv_blocks(
            model.kv_bytes_per_token(),
            block_size=llm_args.block_size,
            max_model_len=max_model_len,
            device=torch.device("cpu"),
            kv_cache_tokens=None,
            gpu_memory_utilization=0.9,
            cpu_kv_cache_gib=llm_args.cpu_kv_cache_gib,
        )
        engine_config = EngineConfig(
            max_model_len=max_model_len,
            num_blocks=blocks,
            block_size=llm_args.block_size,
            max_num_seqs=llm_args.max_num_seqs,
            max_num_batched_tokens=llm_args.max_num_batched_tokens,
            max_queued=10_000,
            stream_interval_s=llm_args.stream_interval_ms / 1000,
            cpu_threads=threads,
        )
        self.image_token_id = config.image_token_id
        self.engine = Engine(
            model,
            engine_config,
            image_token_id=config.image_token_id,
            merge_size=self.processing.merge_size,
            eos_token_ids=set(),
        )

    def _prepare(self, req: BenchRequest) -> tuple[list[int], list, list[MediaItem]]:
        messages = ChatCompletionRequest.model_validate(chat_body(req, "m")).messages
        images = [load_rgb(png) for png in req.images]
        items = [
            MediaItem(
                f"{hashlib.sha256(png).hexdigest()}:{im.width}x{im.height}",
                self.processing.grid_thw(im.width, im.height),
                self.processing.num_image_tokens(im.width, im.height),
                self.image_token_id,
            )
            for png, im in zip(req.images, images, strict=True)
        ]
        counts = [item.num_tokens for item in items]
        return build_prompt(self.tokenizer, messages, self.image_token_id, counts), images, items

    async def _one(self, i: int, req: BenchRequest, t0: float) -> RequestResult:
        sent = time.perf_counter()
        result = RequestResult(i, ok=False, sent=sent - t0, expected_tokens=req.output_len)
        prompt, images, items = self._prepare(req)
        embeds = await asyncio.to_thread(self.vision.encode, images) if images else []  # as an encoder replica
        params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
        last = None
        inp = GenerateRequest(request_id=f"b{i}", prompt_token_ids=prompt, sampling=params, items=items)
        async for chunk in self.engine.generate(inp, embeds):
            now = time.perf_counter()
            if last is None:
                result.ttft = now - sent
            else:
                result.itls.append(now - last)
            last, result.chunks = now, result.chunks + 1
            result.output_tokens += len(chunk.token_ids)
        result.e2e, result.prompt_tokens, result.ok = time.perf_counter() - sent, len(prompt), True
        return result

    def run(self, requests: list[BenchRequest], concurrency: int) -> tuple[list[RequestResult], float]:
        async def main():
            gate, t0 = asyncio.Semaphore(concurrency), time.perf_counter()

            async def task(i: int, req: BenchRequest) -> RequestResult:
                async with gate:
                    return await self._one(i, req, t0)

            results = await asyncio.gather(*(task(i, r) for i, r in enumerate(requests)))
            return list(results), time.perf_counter() - t0

        return asyncio.run(main())
