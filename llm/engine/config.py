"""The engine's settings (the LLM deployment fills them from `llm.*`, schemas/config.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    max_model_len: int
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_queued: int = 64
    enable_prefix_caching: bool = True
    stream_interval_s: float = 0.02
    cpu_threads: int | None = None  # CPU: torch threads of the worker thread alone (threads.py); None: leave as is
    cpu_threads_max: int | None = None  # above cpu_threads: the worker takes up to this many while the node is idle
    cpu_threads_max_rows: int = 256  # ...for steps of at least this many rows (prefill chunks); smaller on cpu_threads
    static_decode: bool | None = None  # decode-only steps through decode_step.py; None: on cuda with one rank
    cuda_graphs: bool | None = None  # replay them as CUDA graphs; None: on cuda with one rank
    compile_decode: bool = False  # the static step through torch.compile (decode_step.py)
    async_decode: bool | None = None  # launch a static step before the last one's tokens are in; None: on cuda
    cpu_packed_weights: bool = True  # CPU, one rank: GEMMs on packed copies, ours or oneDNN's (layers.pack_linears)
    cpu_helper_thread: bool = True  # CPU, one rank, 2+ CPUs: decode attention and GEMMs share tasks with a helper

    def __post_init__(self) -> None:
        assert self.num_blocks * self.block_size >= self.max_model_len, "the cache must hold one full sequence"


__all__ = ["EngineConfig"]
