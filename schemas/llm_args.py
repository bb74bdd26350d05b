"""The LLM replica's settings: `args.llm` of serve_config.yaml (schemas/config.py holds the rest)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class LLMArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_model_len: int | None = Field(
        None, ge=16, description="Context length (prompt + completion); default: the checkpoint's, capped at 32768."
    )
    max_queued_requests: int = Field(
        64, ge=1, description="Requests waiting for the engine; past this a request gets 503 + Retry-After."
    )
    max_num_seqs: int = Field(64, ge=1, description="Most sequences in the running batch.")
    max_num_batched_tokens: int = Field(
        1024, ge=16, description="Tokens per engine step (decodes + prefill chunks); long prompts go in chunks."
    )
    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV-cache block (the unit of prefix reuse).")
    kv_cache_tokens: int | None = Field(
        None, ge=16, description="KV-cache size in tokens; default: from gpu_memory_utilization or cpu_kv_cache_gib."
    )
    gpu_memory_utilization: float = Field(
        0.85, gt=0.0, le=0.98, description="On cuda: the share of GPU memory that weights + KV cache may use."
    )
    cpu_kv_cache_gib: float = Field(1.0, gt=0.0, description="On cpu: KV-cache size in GiB.")
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV of a repeated prefix (same tokens, same images) across requests."
    )
    stream_interval_ms: float = Field(
        20.0,
        ge=0.0,
        description="Tokens arriving within this interval go out as one message (per channel, or per "
        "stream without one).",
    )
    overlap_encoding: bool = Field(
        True,
        description="Prefill a request up to its first image not encoded yet, and on as each arrives (prefill "
        "overlapped with encoding); false: a request enters the engine once all its images are encoded.",
    )
    token_channel: bool = Field(
        True,
        description="Each ingress replica gets each step's tokens of all its streams on one LLM replica as one "
        "message (deployments/channel.py); false: one message per stream.",
    )
    token_channel_idle_s: float = Field(
        5.0,
        gt=0.0,
        description="A channel with no stream for this long closes (a draining replica waits for it); "
        "the first requests after that stream on their own until it is open again.",
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads of the engine's worker on cpu (the replica's other threads use one); "
        "default: the CPUs Ray reserved for the replica (its num_cpus).",
    )
    cpu_threads_max: int | None = Field(
        None,
        ge=1,
        description="On cpu, above cpu_threads: for steps of cpu_threads_max_rows rows or more, the worker takes more "
        "threads, up to this many, while the node's other processes (encoders, ingress) leave cores idle and no image "
        "is being encoded for its sequences, and gives them back when they want them; default: a fixed cpu_threads "
        "(serve_config.yaml sets 2 for a 2-core machine: docs/engine.md).",
    )
    cpu_threads_max_rows: int = Field(
        256,
        ge=0,
        description="With cpu_threads_max: only steps of at least this many rows (prefill chunks, whose GEMMs "
        "take milliseconds) take the threads above cpu_threads; smaller ones (decode steps) run on cpu_threads, and "
        "so do steps while an image is being encoded for the engine, which keep to this many rows. 0: every step.",
    )
    cpu_packed_weights: bool = Field(
        True,
        description="On cpu in float32, and in bfloat16 where the CPU computes in bfloat16 (AVX-512-BF16, AMX): the "
        "linear layers' weights are also held in a packed layout, built at start, and the GEMMs read that (faster "
        "for decode batches): in float32 on AVX2 CPUs our GEMM's panels of 16 columns, elsewhere oneDNN's; costs a "
        "second copy of those weights in memory (false: torch's GEMM on the checkpoint's layout, and in bfloat16 our "
        "kernel for decode rows).",
    )
    cpu_helper_thread: bool = Field(
        True,
        description="On cpu with one rank: a decode step's attention, and the GEMMs of a step on one thread, share "
        "their tasks (the attention's rows and heads, the GEMMs' column chunks) with a helper thread at the "
        "lowest priority, which takes tasks while the node leaves a core idle; the engine never waits for a task the "
        "helper has not started, and takes over one it was preempted in (docs/engine.md). Needs 2 CPUs or more.",
    )
    cuda_graphs: bool | None = Field(
        None,
        description="On cuda with one rank: decode-only steps replay CUDA graphs captured at start, one per "
        "batch bucket (false: the same static step, eager); default: on for cuda, off on cpu (where the eager step "
        "reads only the blocks a batch uses).",
    )
    compile_decode: bool = Field(
        False,
        description="The static decode step (on cuda by default; see cuda_graphs) through torch.compile before any "
        "graph is captured: Inductor fuses the elementwise ops between the GEMMs. Compiling takes time at replica "
        "start (logged); a step that cannot be compiled runs eagerly, said in the log.",
    )
    async_decode: bool | None = Field(
        None,
        description="Launch each decode-only step before the last one's tokens reach the host (its input tokens "
        "taken on the device), so that the host's work between two steps overlaps the device's, as vLLM's "
        "asynchronous scheduling does; rows with a grammar, penalties, logprobs or a pending min_tokens run "
        "synchronously. Default: on with the static decode step (cuda, one rank), where it is the host's time alone.",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Ranks (one GPU each) that one LLM replica's model is split over, packed on one "
        "node: attention heads, the MLP and the KV cache are sharded; it must divide the heads and KV heads.",
    )


__all__ = ["LLMArgs"]
