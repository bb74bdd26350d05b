"""Which tokens run in the next step: continuous batching under a token budget, with chunked prefill.

Each step, running sequences go first, oldest first: a decoding sequence gets its one token, a sequence still
in prefill gets the next chunk that fits the budget. Then waiting sequences are admitted (first come, first
served) while the budget, the batch size and the KV blocks allow, reusing cached prefix blocks. When the cache
runs out mid-generation, the newest running sequence is preempted: its blocks go back to the pool and it waits
again, to be recomputed (its prefix blocks are often still cached then). A prompt's tokens run up to its first
image whose embeddings have not arrived (prefill overlapped with encoding): a sequence is admitted as soon as it is
queued, and one with nothing to run waits for them in its place without holding the others back.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from llm.engine.block_pool import BlockPool
from llm.engine.grammar import OffGrammar
from llm.engine.sequence import Sequence
from schemas import FinishReason


@dataclass(slots=True)
class Chunk:
    seq: Sequence
    start: int
    n: int

    @property
    def completes(self) -> bool:
        """It reaches the sequence's last known token, so the step samples the next one."""
        return self.start + self.n == len(self.seq.token_ids)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool, self.max_num_seqs, self.max_num_batched_tokens = pool, max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.watermark = max(1, pool.num_blocks // 100)  # headroom so admissions do not force preemptions
        self.num_preemptions = self.num_cancelled = 0

    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.pool.block_size)

    def schedule(self, budget: int | None = None) -> list[Chunk]:
        """The next step's chunks, at most `budget` rows (default max_num_batched_tokens, never more)."""
        self._drop_cancelled()
        budget, out, i = min(budget or self.max_num_batched_tokens, self.max_num_batched_tokens), [], 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_schedulable(seq.num_computed), budget)
            if n == 0:  # it waits for an image's embeddings; the others go on
                i += 1
                continue
            if not self._reserve(seq, seq.num_computed + n):
                self.preempt(seq)  # it is the newest left: nothing younger to take blocks from
                continue
            out.append(Chunk(seq, seq.num_computed, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.running.append(chunk.seq)
            if chunk.n:  # none: admitted, its first image not arrived yet
                out.append(chunk)
                budget -= chunk.n
        return out

    def schedule_ahead(self, chunks: list[Chunk]) -> tuple[list[Chunk], list[int]] | None:
        """The decode step after `chunks`, a decode-only step whose tokens are not known yet, when it is the step
        `schedule` would pick: every running sequence is in it, none waits or was cancelled, and the blocks of their
        next tokens are free without preempting. A sequence whose max_tokens that step reaches is left out. Returns
        the chunks and each one's row in `chunks`; None: `schedule` once the tokens are in."""
        if self.waiting or len(self.running) != len(chunks) or any(c.seq.cancelled.is_set() for c in chunks):
            return None
        rows = [i for i, c in enumerate(chunks) if c.seq.num_generated + 1 < c.seq.params.max_tokens]
        ends = [chunks[i].start + 2 for i in rows]  # tokens the sequence holds after the step ahead
        need = sum(max(0, self._blocks_for(n) - len(chunks[i].seq.block_ids)) for i, n in zip(rows, ends))
        if not rows or need > self.pool.num_free:
            return None
        for i, n in zip(rows, ends):
            self._reserve(chunks[i].seq, n)
        return [Chunk(chunks[i].seq, chunks[i].start + 1, 1) for i in rows], rows

    def _admit(self, seq: Sequence, budget: int) -> Chunk | None:
        bs = self.pool.block_size
        # At least one token left to compute; none cached for a prefill that must compute the prompt's logprobs
        # (vLLM skips the prefix cache for prompt_logprobs too). Its blocks are still registered for others.
        hashes = [] if seq.needs_prompt_logprobs else seq.prefix_hashes(bs, len(seq.token_ids) - 1)
        hits = self.pool.match_prefix(hashes)
        cached = len(hits) * bs
        n = min(seq.num_schedulable(cached), budget)  # up to the first image not arrived
        need = self._blocks_for(cached + n) - len(hits)
        headroom = self.watermark if self.running else 0
        if need + self.pool.num_reusable(hits) + headroom > self.pool.num_free:
            return None
        self.pool.record_lookup(len(hashes), len(hits))
        self.pool.take(hits)
        seq.block_ids = hits + self.pool.allocate(need)
        seq.block_hashes = hashes[: len(hits)]
        seq.num_computed = cached
        if seq.num_cached is None:  # a preempted sequence readmitted keeps what its first admission found
            seq.num_cached = cached
        return Chunk(seq, cached, n)

    def _reserve(self, seq: Sequence, n_tokens: int) -> bool:
        need = self._blocks_for(n_tokens) - len(seq.block_ids)
        while need > self.pool.num_free:
            victim = self.running[-1]
            if victim is seq:
                return False
            self.preempt(victim)
        if need > 0:
            seq.block_ids += self.pool.allocate(need)
        return True

    def advance(self, chunk: Chunk) -> None:
        """The chunk's KV is computed: newly full blocks become reusable by other sequences."""
        seq, bs = chunk.seq, self.pool.block_size
        before = len(seq.block_hashes)
        seq.num_computed += chunk.n
        full = seq.num_computed // bs
        if full > before:
            seq.block_hashes = seq.prefix_hashes(bs, full * bs)
            for i in range(before, full):
                self.pool.register(seq.block_ids[i], seq.block_hashes[i])

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seq: Sequence, token: int) -> FinishReason | None:
        """The stop rules, after a step sampled `token` for `seq`: a stop token (EOS unless the request ignores it),
        the end of its grammar, or max_tokens finishes it (its blocks go back to the pool). A token its grammar does
        not take ends it too, without the token: OffGrammar, for the engine to fail it alone."""
        ended = False
        if seq.matcher is not None:  # the mask allowed only this grammar's tokens: the matcher must take it
            if not seq.matcher.accept_token(token):  # its grammar dead-ended (no token was allowed), or a bug
                self.finish(seq)
                raise OffGrammar(seq.matcher, token)
            ended = seq.matcher.is_terminated()  # it took a stop token where the grammar may end
        seq.token_ids.append(token)
        finish: FinishReason | None = (
            "stop"
            if token in seq.stop_token_ids or ended
            else "length"
            if seq.num_generated >= seq.params.max_tokens
            else None
        )
        if finish is not None:
            self.finish(seq)
        return finish

    def finish(self, seq: Sequence) -> None:
        """It ends, running or waiting: out of the batch, its blocks back to the pool."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def holds(self, seq: Sequence) -> bool:
        """It is running or waiting: it has not ended."""
        return seq in self.running or seq in self.waiting

    def _free(self, seq: Sequence) -> None:
        self.pool.release(seq.block_ids)
        seq.block_ids, seq.num_computed = [], 0

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.running if s.cancelled.is_set()]:
            self.finish(seq)
            self.num_cancelled += 1
        if any(s.cancelled.is_set() for s in self.waiting):
            self.num_cancelled += sum(s.cancelled.is_set() for s in self.waiting)
            self.waiting = deque(s for s in self.waiting if not s.cancelled.is_set())

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def awaits_images(self) -> bool:
        """Some sequence, running or waiting, has an image not encoded yet: an encoder is busy for this engine."""
        return any(s.num_missing for s in self.running) or any(s.num_missing for s in self.waiting)


__all__ = ["Chunk", "Scheduler"]
