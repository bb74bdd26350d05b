"""The model runner: one step's inputs (embeddings with the images merged in, positions, the attention metadata),
the forward pass, the logits of the rows that sample, and the sampled tokens. It owns the KV cache tensors."""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass

import torch
from torch import nn

from llm.engine.decode_step import StaticDecode
from llm.engine.grammar import fill_bitmask
from llm.engine.sampling import RowState, on_device, prompt_logprobs, sample, sample_tokens
from llm.engine.scheduler import Chunk
from llm.engine.sequence import Sequence
from llm.model import cpu_kernels
from llm.model.attention import BatchMeta, ChunkSpec
from llm.model.layers import pack_linears
from llm.model.model import merge_image_embeds
from schemas import TokenLogprob

logger = logging.getLogger(__name__)

# A step's DeepStack features (Qwen3-VL): the batch's rows that get them (R,), and theirs (R, levels, D).
Deepstack = tuple[torch.Tensor, torch.Tensor]
PROMPT_LOGPROB_ROWS = 256  # prompt rows per logits slice: a long prefill never holds (T, V) logits at once


@dataclass(slots=True)
class Sampled:
    seq: Sequence
    token: int
    logprob: TokenLogprob | None


@dataclass(slots=True)
class Launched:
    """A decode step queued on the device (`ModelRunner.launch`): its rows' sequences and sampled tokens, (B,) long on
    the device, their copy on the host once `event` (cuda) has passed."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    host: torch.Tensor
    event: torch.cuda.Event | None


def _plain(seq: Sequence) -> bool:
    """The row's sampling needs nothing of the host's token history, so it can run before its last token is known."""
    params, state = seq.params, seq.logits_state
    return (
        seq.matcher is None
        and not params.logprobs
        and state is not None
        and state.counts is None
        and state.seen is None
        and state.num_generated >= params.min_tokens
    )


class ModelRunner:
    """`static_decode`: decode-only steps go through llm/engine/decode_step.py (its cache gets one more block, the null
    block of padding rows); `cuda_graphs`: and replay captured graphs (cuda only); None: both on cuda with one rank.
    Once the cache is allocated, the largest step runs once (`check_peak_step`)."""

    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int,
        *,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        static_decode: bool | None = None,
        cuda_graphs: bool | None = None,
        compile_decode: bool = False,
        packed_weights: bool = False,
        helper_thread: bool = False,
        decode_threads: int | None = None,
    ):
        self.model, self.block_size = model, block_size
        self.device = model.lm_head.weight.device
        single_cuda = (
            self.device.type == "cuda" and getattr(model, "tp", None) is not None and model.tp.world_size == 1
        )  # a ParallelLM (several ranks) has no .tp: it runs eagerly
        graphs = single_cuda if cuda_graphs is None else cuda_graphs and single_cuda
        static = (single_cuda if static_decode is None else static_decode) or graphs
        if self.device.type == "cpu":
            cpu_kernels.load()  # decode attention in place; built once per machine, loaded in ~1 s after
            if cpu_kernels.available():  # one rank: its tasks shared with a helper thread where there is a second CPU
                helper = helper_thread and isinstance(model, nn.Module) and len(os.sched_getaffinity(0)) > 1
                cpu_kernels.use_helper(helper)
                logger.info(
                    "decode attention and GEMMs: %s",
                    "shared with a helper thread" if helper else "on the engine's threads",
                )
            if packed_weights and isinstance(model, nn.Module):  # one rank (a ParallelLM's ranks keep torch's GEMM)
                started = time.monotonic()
                # oneDNN's in chunks for the helper where decode steps run on one thread (a linear with a team of its
                # own runs its chunks one by one, each a oneDNN call more: cpu_kernels.SHARE_CHUNKS); ours split at
                # each call.
                chunks = cpu_kernels.SHARE_CHUNKS if cpu_kernels.helper_on() and decode_threads == 1 else 1
                n = pack_linears(model, chunks)  # and onto huge pages: about 3 s a GB on this VM's core
                if n:
                    logger.info(
                        "%d linear weights (%s) packed for %s in %.1f s",
                        n,
                        model.lm_head.weight.dtype,
                        "our GEMM" if cpu_kernels.panels_for(model.lm_head.weight) else "oneDNN",
                        time.monotonic() - started,
                    )
        self.cache = model.new_cache(num_blocks + static, block_size)
        self.cache_blocks = num_blocks  # the pool's; a static decode's extra one is its padding rows' null block
        self.static = (
            StaticDecode(model, self.cache, max_num_seqs, max_model_len, graphs, compile_decode) if static else None
        )
        self.check_peak_step(max_num_batched_tokens, max_num_seqs, max_model_len)

    def check_peak_step(self, tokens: int, rows: int, max_model_len: int) -> None:
        """`peak_step` once, at start: out of memory there is an error that names the settings to lower."""
        t = time.perf_counter()
        try:
            ran = self.peak_step(tokens, rows, max_model_len)
        except (torch.OutOfMemoryError, MemoryError) as e:
            raise MemoryError(
                f"one engine step of llm.max_num_batched_tokens={tokens} tokens does not fit in memory beside the "
                f"weights and the KV cache ({self.cache_blocks} blocks of {self.block_size}): lower "
                "llm.max_num_batched_tokens, or the KV cache (llm.gpu_memory_utilization, llm.cpu_kv_cache_gib, "
                f"llm.kv_cache_tokens): {e}"
            ) from e
        logger.info("start-up step: %d tokens in %.0f ms", ran, (time.perf_counter() - t) * 1e3)

    def peak_step(self, tokens: int, rows: int, max_model_len: int) -> int:
        """One forward of `tokens` prefill tokens (in chunks of at most max_model_len, as several sequences would
        come) and the logits of `rows` of them: the largest step the scheduler may run, once at start, so that a
        replica without the memory for it fails now and says which setting to lower, not under its first peak of
        load (it also warms the GEMMs' caches). Writes KV into free blocks only. Returns the tokens it ran (fewer
        when the cache holds fewer)."""
        tokens = min(tokens, self.cache_blocks * self.block_size)
        chunks, block = [], 0
        for start in range(0, tokens, max_model_len):
            n = min(max_model_len, tokens - start)
            used = -(-n // self.block_size)
            if block + used > self.cache_blocks:
                break
            chunks.append(ChunkSpec(list(range(block, block + used)), 0, n))
            block += used
        tokens = sum(c.n for c in chunks)
        if tokens < 2:
            return tokens
        ids = torch.zeros(tokens, dtype=torch.long)
        positions = torch.cat([torch.arange(c.n) for c in chunks]).expand(3, -1)
        meta = BatchMeta.build(chunks, self.block_size, self.device)
        with torch.inference_mode():
            hidden = self.model(self.model.embed(ids), positions, self.cache, meta)
            self.model.logits(hidden, list(range(tokens - min(rows, tokens), tokens))).sum().item()  # one sync
        return tokens

    def _embed(self, chunk: Chunk) -> tuple[torch.Tensor, Deepstack | None]:
        """Input embeddings of the chunk's tokens, image rows merged in (the one merge); and where an image's
        embedding carries DeepStack levels after its D columns (Qwen3-VL: encoders/qwen3_vl.py), the chunk's rows
        that get them and their features (R, L, D)."""
        seq, a, b = chunk.seq, chunk.start, chunk.start + chunk.n
        x = self.model.embed(torch.tensor(seq.token_ids[a:b]))  # (n, D)
        rows = seq.image_rows(a, b)
        if rows is None:
            return x, None
        mask, embeds = rows  # (n,), (R, (1 + L) * D)
        d = x.shape[1]
        if embeds.shape[1] % d:
            raise ValueError(f"image embeddings have width {embeds.shape[1]}, the LM hidden size is {d}")
        x = merge_image_embeds(x, mask, embeds[:, :d].contiguous())
        if embeds.shape[1] == d:
            return x, None
        return x, (mask.nonzero().flatten(), embeds[:, d:].unflatten(1, (-1, d)))

    def _inputs(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor, Deepstack | None]:
        """Embeddings (T, D), positions (3, T) and DeepStack features (rows of the batch) of the batch; decode
        tokens (generated text) in one lookup."""
        n_dec = next((i for i, c in enumerate(chunks) if c.n != 1 or c.start < c.seq.prompt_len), len(chunks))
        embeds, positions, deepstack, offset = [], [], [], 0
        if n_dec:
            dec = chunks[:n_dec]
            embeds.append(self.model.embed(torch.tensor([c.seq.token_ids[c.start] for c in dec])))
            positions.append(torch.tensor([c.start + c.seq.rope_delta for c in dec]).expand(3, -1))
            offset = n_dec
        for c in chunks[n_dec:]:
            x, stack = self._embed(c)
            embeds.append(x)
            positions.append(c.seq.positions(c.start, c.start + c.n))
            if stack is not None:
                deepstack.append((stack[0] + offset, stack[1]))
            offset += c.n
        if deepstack:
            rows, features = (torch.cat(parts) for parts in zip(*deepstack, strict=True))
            return torch.cat(embeds), torch.cat(positions, dim=1), (rows.to(self.device), features.to(self.device))
        return torch.cat(embeds), torch.cat(positions, dim=1), None

    def run(self, chunks: list[Chunk]) -> list[Sampled]:
        """One forward over the chunks (one-token chunks first, shortest context first); a token for each chunk
        that completes its sequence's known tokens."""
        if self.static is not None and all(c.n == 1 and c.start >= c.seq.prompt_len for c in chunks):
            return self._decode(chunks)
        embeds, positions, deepstack = self._inputs(chunks)  # (T, D), (3, T)
        meta = BatchMeta.build([ChunkSpec(c.seq.block_ids, c.start, c.n) for c in chunks], self.block_size, self.device)
        ends = itertools.accumulate(c.n for c in chunks)
        rows = [(c.seq, end - 1) for c, end in zip(chunks, ends) if c.completes]
        mask = self._grammar_mask([s for s, _ in rows])
        hidden = self.model(embeds, positions, self.cache, meta, deepstack)  # (T, D)
        if any(c.seq.needs_prompt_logprobs for c in chunks):
            self._prompt_logprobs(hidden, chunks)
        if not rows:
            return []
        return self._sample_logits(self.model.logits(hidden, [r for _, r in rows]), [s for s, _ in rows], mask)

    def _prompt_logprobs(self, hidden: torch.Tensor, chunks: list[Chunk]) -> None:
        """The prompt logprobs of the chunks whose sequence asks, appended to it: the row of prompt position i
        predicts token i + 1, up to the prompt's last token (the last row samples the first generated one)."""
        offset = 0  # the chunk's first row in hidden (T, D)
        for c in chunks:
            seq = c.seq
            if seq.needs_prompt_logprobs:
                done = len(seq.prompt_logprobs)  # positions 0..done-1 have theirs (a recompute skips them)
                assert c.start <= done, (c.start, done)  # its prefill computes every row (no prefix-cache hits)
                end = min(c.start + c.n, seq.prompt_len - 1)
                for a in range(done, end, PROMPT_LOGPROB_ROWS):
                    b = min(a + PROMPT_LOGPROB_ROWS, end)
                    logits = self.model.logits(hidden, list(range(offset + a - c.start, offset + b - c.start)))
                    seq.prompt_logprobs += prompt_logprobs(
                        logits, seq.token_ids[a + 1 : b + 1], seq.params.prompt_logprobs
                    )
            offset += c.n

    def _decode(self, chunks: list[Chunk]) -> list[Sampled]:
        """A decode-only step through the static buffers (every chunk is one generated token)."""
        seqs = [c.seq for c in chunks]
        rows = self._prepare(chunks, [s.token_ids[c.start] for s, c in zip(seqs, chunks)])
        mask = self._grammar_mask(seqs)
        return self._sample_logits(self.static.run(len(chunks), rows), seqs, mask)

    def _prepare(self, chunks: list[Chunk], tokens: list[int] | torch.Tensor) -> int:
        return self.static.prepare(
            tokens, [c.start + c.seq.rope_delta for c in chunks], [c.seq.block_ids for c in chunks],
            [c.start + 1 for c in chunks],
        )  # fmt: skip

    def can_launch(self, chunks: list[Chunk]) -> bool:
        """A decode-only step whose rows sample from the logits alone (no grammar, penalty, pending min_tokens or
        logprobs: those read the host's token history), so that `launch` queues it without waiting for the device."""
        return self.static is not None and all(
            c.n == 1 and c.start >= c.seq.prompt_len and _plain(c.seq) for c in chunks
        )

    def launch(self, chunks: list[Chunk], after: Launched | None = None, rows: list[int] | None = None) -> Launched:
        """Queue a `can_launch` step and its sampling on the device, no host sync; `collect` takes its tokens.
        `after`: the step before, not collected yet; row i of this one feeds on the token of its row `rows[i]`."""
        seqs = [c.seq for c in chunks]
        if after is None:
            tokens = [s.token_ids[c.start] for s, c in zip(seqs, chunks)]
        else:
            assert rows is not None and len(rows) == len(chunks), (rows, len(chunks))
            device = after.tokens.device
            same = rows == list(range(len(rows)))
            tokens = after.tokens[: len(rows)] if same else after.tokens[on_device(rows, torch.long, device)]
        logits = self.static.run(len(chunks), self._prepare(chunks, tokens))
        states = [s.logits_state for s in seqs]
        out = sample_tokens(logits, [s.params for s in seqs], [s.generator for s in seqs], states)
        if not out.is_cuda:
            return Launched(seqs, out, out, None)
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return Launched(seqs, out, host, event)

    def collect(self, step: Launched) -> list[Sampled]:
        """A launched step's tokens (waits for it), added to each row's history."""
        if step.event is not None:
            step.event.synchronize()
        tokens = step.host.tolist()
        for s, token in zip(step.seqs, tokens, strict=True):
            s.logits_state.add(token)
        return [Sampled(s, t, None) for s, t in zip(step.seqs, tokens, strict=True)]

    def _grammar_mask(self, seqs: list[Sequence]) -> tuple[torch.Tensor, list[int]] | None:
        """The grammar rows' bitmask, filled on the host before the forward is launched (it overlaps the device)."""
        return fill_bitmask([s.matcher for s in seqs], self.model.config.vocab_size)

    def _sample_logits(
        self, logits: torch.Tensor, seqs: list[Sequence], mask: tuple[torch.Tensor, list[int]] | None
    ) -> list[Sampled]:
        """logits (B, V) of `seqs`, in order -> their next tokens (one host sync for the batch)."""
        for s in seqs:
            if s.logits_state is None:  # its first sampling: the logits' width and device are known now
                prompt = s.token_ids[: s.prompt_len]
                s.logits_state = RowState.start(s.params, prompt, s.stop_token_ids, logits.shape[-1], logits.device)
        states = [s.logits_state for s in seqs]
        tokens, logprobs = sample(logits, [s.params for s in seqs], [s.generator for s in seqs], states, mask)
        for state, token in zip(states, tokens, strict=True):
            state.add(token)
        return [Sampled(s, t, lp) for s, t, lp in zip(seqs, tokens, logprobs, strict=True)]


__all__ = ["Launched", "ModelRunner", "Sampled"]
